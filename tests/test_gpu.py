"""GPU paths (NCCL stream lanes), world size 1. Skipped where no CUDA device exists."""

import math
import os
import re
import sys

import pytest
import torch

from ._launch import gpus_visible, hide_gpus, mpiexec_or_skip, pythonpath, run_launcher

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): the nccl/rccl lanes and "
    "the GPU examples run only on a GPU machine",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
GPU = os.path.join(ROOT, "tests", "gpu")


@pytest.fixture(autouse=True, scope="module")
def _launches_see_the_gpus():
    """tests/conftest.py hides the GPUs from the processes the CPU suite starts; these
    launches are the GPU suite's."""
    hidden = gpus_visible()
    yield
    if hidden:
        hide_gpus()


def test_listing3_overlap_on_nccl():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(EXAMPLES, "listing3_overlap.py"), "nccl"], timeout=300)
    assert "nccl, 1 ranks: compute" in out and "all_reduce results OK" in out, out


def test_listing4_nccl_and_mpi():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(EXAMPLES, "listing4_two_backends.py"), "--gpu"],
                       timeout=300)
    assert "all_reduce on nccl and all_to_all_single on mpi completed" in out, out


def test_nccl_ops_world_of_one():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(os.path.dirname(__file__), "gpu", "nccl_ops.py")],
                       timeout=300)
    assert "nccl ops OK" in out, out


@pytest.mark.parametrize("script,expect", [
    ("extensions_cuda.py", "cuda extensions OK"),
    ("torch_ddp_cuda.py", "torch ddp cuda OK"),
])
def test_call_path_on_cuda(script, expect):
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(GPU, script)], timeout=300)
    assert expect in out, out


# Each engine's entry point, one GPU rank: the GPU paths of training/ (nccl lanes, pinned
# optimizer offload, bf16 autocast, kernel tuning, the MoE dispatch) on the real device.
ENTRY_POINTS = {
    "pipeline-bf16-offload": ["training.train_gpt", "--dtype", "bf16", "--offload-optimizer",
                              "--activation-checkpointing"],
    "4d-tuned-overlap": ["training.train_gpt", "--engine", "4d", "--tune-matmul",
                         "--overlap", "all"],
    "samo-pruned": ["training.train_gpt", "--samo", "--prune-sparsity", "0.5", "--dtype", "bf16"],
    "moe-dtd-cac": ["training.train_moe", "--dtd", "--cac", "--activation-checkpointing",
                    "--dtype", "bf16"],
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_point_on_gpu(name, tmp_path):
    cmd = [mpiexec_or_skip(), "-n", "1", sys.executable, "-m", *ENTRY_POINTS[name],
           "--model", "tiny", "--steps", "3", "--device", "cuda", "--no-plot",
           "--out-dir", str(tmp_path), "--metrics", str(tmp_path / "m.jsonl")]
    out = run_launcher(cmd, env=dict(os.environ, PYTHONPATH=pythonpath(ROOT), MCRDL_TIMEOUT="120"),
                       timeout=300)
    losses = [float(x) for x in re.findall(r"step +\d+/3 \| loss (\S+)", out)]
    assert len(losses) == 3 and all(math.isfinite(v) and 0 < v < 10 for v in losses), out


def _losses(out: str, steps: int) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(rf"step +(\d+)/{steps} \| loss (\S+)", out)}


# A checkpoint written on the GPU: resuming it gives the uninterrupted run's losses (to the
# printed digits, within 1e-4: CUDA's atomic scatter-adds may reorder sums), and
# consolidate (--masters where a bf16 run keeps them) feeds --init-from.
ROUND_TRIPS = {
    "pipeline-bf16-offload": (["training.train_gpt", "--dtype", "bf16", "--offload-optimizer"],
                              ["--masters"]),
    "moe": (["training.train_moe"], []),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_checkpoint_round_trip_on_gpu(name, tmp_path):
    entry, consolidate = ROUND_TRIPS[name]
    env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), MCRDL_TIMEOUT="120")

    def train(*extra):
        cmd = [mpiexec_or_skip(), "-n", "1", sys.executable, "-m", *entry, "--model", "tiny",
               "--steps", "4", "--device", "cuda", "--no-plot", "--no-progress",
               "--out-dir", str(tmp_path), *extra]
        return run_launcher(cmd, env=env, timeout=300)

    whole = _losses(train("--checkpoint-dir", str(tmp_path / "a")), 4)
    first = train("--checkpoint-dir", str(tmp_path / "b"), "--stop-after", "2")
    resumed = train("--checkpoint-dir", str(tmp_path / "b"), "--resume")
    assert sorted(whole) == [1, 2, 3, 4] and "resumed from" in resumed and "at step 2" in resumed
    got = {**_losses(first, 4), **_losses(resumed, 4)}
    assert sorted(got) == [1, 2, 3, 4], (first, resumed)
    assert all(abs(float(got[s]) - float(whole[s])) <= 1e-4 for s in whole), (whole, got)
    out = run_launcher([sys.executable, "-m", "training.checkpoint", "consolidate",
                        str(tmp_path / "b"), "-o", str(tmp_path / "w.pt"), *consolidate],
                       env=env, timeout=120)
    assert os.path.exists(tmp_path / "w.pt"), out
    started = train("--init-from", str(tmp_path / "w.pt"))
    losses = _losses(started, 4)
    assert "--init-from" in started and sorted(losses) == [1, 2, 3, 4], started
    assert all(math.isfinite(float(v)) and 0 < float(v) < 10 for v in losses.values()), started


def test_engines_benchmark_on_one_gpu(tmp_path):
    """benchmarks/engines.py --device cuda, reduced (the `small` GPT, one round): the dense
    engines and their NCCL peers pass bf16 parity and report an MFU against the GPU's
    bf16 peak. The full figure: python benchmarks/engines.py --device cuda --ranks 1."""
    mpiexec_or_skip()
    out = run_launcher([sys.executable, os.path.join(ROOT, "benchmarks", "engines.py"),
                        "--device", "cuda", "--ranks", "1", "--model", "small",
                        "--global-batch", "8", "--rounds", "1", "--steps", "3",
                        "--warmup", "1", "--parity-steps", "3",
                        "--png", str(tmp_path / "engines.png")],
                       env=dict(os.environ, PYTHONPATH=pythonpath(ROOT)), timeout=900)
    for peer in ("ddp-nccl", "fsdp2-nccl"):
        assert re.search(rf"^parity {peer}: max .*: ok$", out, re.M), out
    for name in ("dp", "ddp-nccl", "4d-z", "fsdp2-nccl"):
        m = re.search(rf"^{name} +\d+ .* (\d+\.\d)%$", out, re.M)
        assert m and 0 < float(m.group(1)) < 100, out
