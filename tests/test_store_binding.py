"""The store mcrdl hosts for its bootstrap listens on the address the launch gave it, not on
every interface: every rank unpickles what the store carries (object collectives), so the
job is the trust boundary (docs/api.md, "Object collectives"). torch's own TCPStore server
listens on every interface whatever host name it is given."""

import json
import pathlib
import sys

from ._launch import clean_env, mpiexec_or_skip, run_launcher

PROGRAM = pathlib.Path(__file__).resolve().parent / "store" / "listening.py"


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"rank"')]


def _check(lines: list[dict], ranks: int) -> None:
    assert sorted(d["rank"] for d in lines) == list(range(ranks)), lines
    assert len({d["port"] for d in lines}) == 1, lines
    host = next(d for d in lines if d["rank"] == 0)
    # one listening socket, on loopback alone (a single-node job's address), never 0.0.0.0
    assert host["listening"] == ["127.0.0.1"], host


def test_single_process_store_listens_on_loopback_only():
    out = run_launcher([sys.executable, str(PROGRAM)], env=clean_env())
    _check(_lines(out), 1)


def test_mpi_world_store_listens_on_the_broadcast_address_only():
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable, str(PROGRAM)],
                       env=clean_env())
    _check(_lines(out), 2)
