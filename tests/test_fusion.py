"""Tensor fusion on real multi-rank worlds (the rank script is tests/fusion/fusion_ranks.py):
randomized calls over mpi, gloo and auto, mixed sizes, groups, async and blocking calls,
fused results bit-identical to unfused ones; plus single-process checks of the settings."""

import os
import re
import sys

import pytest

import mcrdl
from mcrdl.fusion import FusionConfig

from ._launch import mpiexec_or_skip, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "fusion")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(n, script, *args, timeout=240, env=None):
    """Run `script` on n ranks with this checkout's mcrdl first on the path."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO, *filter(None, [os.environ.get("PYTHONPATH")])]), **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [mpiexec_or_skip(), "-n", str(n), sys.executable, os.path.join(HERE, script),
           *map(str, args)]
    return run_launcher(cmd, env=full_env, timeout=timeout)


@pytest.mark.parametrize(("n", "rounds"), [(3, 4), (4, 6)])
def test_fusion_randomized_bit_identical(n, rounds):
    out = launch(n, "fusion_ranks.py", rounds, 50)
    m = re.search(r"fusion OK randomized: world (\d+), (\d+) rounds, (\d+) calls on rank 0 "
                  r"checked bit-identical; all ranks: (\d+) calls fused in (\d+) flushes, "
                  r"(\d+) flushes where ranks had buffered different calls", out)
    assert m, out
    world, _, checked, calls, flushes, short = map(int, m.groups())
    assert world == n and checked >= rounds * 20, out
    assert calls > flushes > 0, out  # calls were really combined
    assert short > 0, out  # the agreement resolved flushes that differed between ranks
    assert "fusion OK targeted" in out, out
    print(out[m.start():].strip())


def test_fusion_config_checks_its_fields():
    assert FusionConfig().buffer_bytes == 16 << 20
    for bad in ({"buffer_bytes": 0}, {"buffer_bytes": 1.5}, {"wait_us": -1},
                {"wait_us": float("inf")}, {"ops": {"all_reduce", "send"}}, {"ops": "bcast"}):
        with pytest.raises(mcrdl.InvalidArgumentError, match=next(iter(bad))):
            FusionConfig(**bad)
    with pytest.raises(mcrdl.InvalidArgumentError, match="unknown setting"):
        mcrdl.configure(fusion={"buffer": 4})
    with pytest.raises(mcrdl.InvalidArgumentError, match="fusion"):
        mcrdl.configure(fusion="yes")
    assert not mcrdl.fusion.current().enabled  # refused settings change nothing


def test_extensions_block_restores_the_configuration_outside():
    before = mcrdl.fusion.current()
    with mcrdl.extensions(fusion={"wait_us": 50}) as inside:
        assert inside.fusion.wait_us == 50 and mcrdl.fusion.current() is inside
        with mcrdl.extensions(fusion=False, logging=True) as inner:
            assert inner.fusion is None and inner.logging is not None
        assert mcrdl.fusion.current() is inside
    assert mcrdl.fusion.current() == before
