"""The torch backend without a launcher: processes that torch.multiprocessing.spawn
started and that torch.distributed gives their rank, the world's size and a store
(env://, file://, FileStore, TCPStore). PyTorch's DDP tutorial program on "mcrdl" gives
the losses it gives on gloo, bit for bit."""

import json
import os
import socket
import sys

import pytest
import torch.distributed as dist

import mcrdl
from mcrdl import bootstrap

from ._launch import clean_env, run_launcher, without_launcher

SCRIPT = os.path.join(os.path.dirname(__file__), "torch_backend", "spawn_ddp.py")
WORLD = 2


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _spawned(backends: list[str], out_dir: str) -> list[dict]:
    """Every rank's results of spawn_ddp.py, run for `backends` in one spawn."""
    ports = ",".join(map(str, _free_ports(2 * len(backends))))
    run_launcher([sys.executable, SCRIPT, out_dir, ports, *backends], env=clean_env(),
                 timeout=240)
    results = []
    for rank in range(WORLD):
        with open(os.path.join(out_dir, f"{rank}.json")) as f:
            results.append(json.load(f))
    return results


def test_spawned_ddp_tutorial_and_stores_match_gloo(tmp_path):
    """One spawn for both backends (each rank imports torch once, runs gloo then mcrdl):
    the DDP tutorial on env://, then file://, FileStore and TCPStore, each with
    all_reduce over the world and over new_group sub-groups (every rank reversed, rank 1
    alone) and a broadcast."""
    results = _spawned(["gloo", "mcrdl"], str(tmp_path))
    gloo, ours = [r["gloo"] for r in results], [r["mcrdl"] for r in results]
    for rank in range(WORLD):
        g, m = gloo[rank], ours[rank]
        # bitwise: mcrdl routes DDP's gradient all_reduce to Gloo's own algorithm
        assert m["ddp"]["losses"] == g["ddp"]["losses"], (rank, g["ddp"], m["ddp"])
        assert m["ddp"]["params"] == g["ddp"]["params"], (rank, g["ddp"], m["ddp"])
        assert m["ddp"]["backends"] == ["gloo"]  # no MPI launch: MPI does not join
        for mode in ("file://", "FileStore", "TCPStore"):
            want, got = g[mode], m[mode]
            assert got.pop("name") == "mcrdl" and got.pop("backends") == ["gloo"], got
            assert want.pop("name") == "gloo" and want.pop("backends") is None
            assert got == want, (mode, rank, want, got)
            assert got["world"] == [1.0, 3.0, 5.0, 7.0] and got["every"] == [3.0] * 3
            assert got["alone"] == [10.0 + rank] * 2 and got["broadcast"] == [1.0] * 2
    # the ranks trained one model: the same parameters, on different data
    assert ours[0]["ddp"]["params"] == ours[1]["ddp"]["params"]
    assert ours[0]["ddp"]["losses"] != ours[1]["ddp"]["losses"]


def test_a_launcher_that_disagrees_with_torch_is_named(monkeypatch):
    """Under a launcher (here torchrun's variables: a world of one), torch's rank and
    world size must be the launcher's: the error names both."""
    without_launcher(monkeypatch)
    monkeypatch.setattr(bootstrap, "_hosted", {})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_ports(1)[0]))
    try:
        with pytest.raises(mcrdl.BackendUnavailableError,
                           match=r"torch's rank 1 of 2 differs from mcrdl's launch discovery "
                                 r"\(rank 0 of 1, launcher 'torchrun'\)"):
            dist.init_process_group("mcrdl", rank=1, world_size=2, store=dist.HashStore())
    finally:
        mcrdl.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_torch_given_world_and_its_local_rank(monkeypatch):
    """detect() answers the world torch described within given() only; the local rank
    is LOCAL_RANK where set (0 included), else the rank."""
    from mcrdl import launch

    without_launcher(monkeypatch)
    info = launch.torch_given(1, 2, store=None)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size,
            info.mpi_world) == ("torch", 1, 2, 1, 2, False)
    with launch.given(info):
        assert launch.detect() is info
    assert launch.detect().launcher == "single"
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    info = launch.torch_given(1, 2, store=None)
    assert (info.local_rank, info.local_size) == (0, 1)
