"""benchmarks/engines.py: the parity step of every engine against its peers (the `tiny`
GPT, 2 ranks, 2 steps, one mpiexec job per contender, ``--parity-only``): equal losses
from the same initial weights, or the test fails with the script's reason. By default the
optional peers (DeepSpeed's MoE: skipped, saying how to install it, where it is not
installed); with MCRDL_TEST_FULL=1 also the torch peers over the "mcrdl" backend and over
Gloo (about 1-2 minutes each on 2 cores) and a reduced timed run (table, chart,
per-engine lines)."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ._launch import FULL, mpiexec_or_skip

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "engines.py"

# row -> its peers, as benchmarks/engines.py names them at 2 ranks
ROWS = {
    "dp": ("ddp-gloo", "ddp-mcrdl"),
    "pipe": ("gpipe-gloo", "gpipe-mcrdl", "1f1b-gloo", "1f1b-mcrdl"),
    "4d-z": ("fsdp2-gloo", "fsdp2-mcrdl"),
    "4d-x": ("tp-gloo", "tp-mcrdl"),
    "ted": ("dsmoe-gloo", "dsmoe-mcrdl"),
    "samo": ("dense-gloo", "dense-mcrdl"),
}
NEEDS = {"ted": "deepspeed"}


def _run(args, tmp_path, timeout):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path,
                          env=dict(os.environ, MCRDL_TEST_FULL="0"))


def _check_parity(rows, backends, tmp_path):
    out = _run(["--ranks", "2", "--rows", ",".join(rows), "--peer-backends", backends,
                "--model", "tiny", "--micro-batch", "4", "--parity-steps", "2",
                "--parity-only"], tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for row in rows:
        for peer in ROWS[row]:
            if peer.rsplit("-", 1)[1] in backends.split(","):
                assert re.search(rf"^parity {peer}: max .*: ok$", out.stdout, re.M), out.stdout
    assert "parity: every pair ok" in out.stdout, out.stdout


TORCH_ROWS = [r for r in ROWS if r not in NEEDS]


@FULL
def test_parity_of_each_torch_pair_over_mcrdl(tmp_path):
    """Every engine against its torch peers over the "mcrdl" backend (one job each)."""
    mpiexec_or_skip()
    _check_parity(TORCH_ROWS, "mcrdl", tmp_path)


@FULL
def test_parity_of_each_torch_pair_over_gloo(tmp_path):
    """The same peers over Gloo (the same code as over "mcrdl", another backend)."""
    mpiexec_or_skip()
    _check_parity(TORCH_ROWS, "gloo", tmp_path)


@pytest.mark.parametrize("row", list(NEEDS))
def test_parity_of_optional_peers(row, tmp_path):
    mpiexec_or_skip()
    module = NEEDS[row]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the {row} row's peer needs {module}: DS_BUILD_OPS=0 pip install "
                    f"{module} (or pip install .[bench])")
    _check_parity([row], "gloo,mcrdl", tmp_path)


def test_unknown_row_names_the_choices(tmp_path):
    out = _run(["--ranks", "2", "--rows", "4d-xz"], tmp_path, timeout=120)
    assert out.returncode == 2
    assert "no row 4d-xz at 2 ranks" in out.stderr and "dp, pipe" in out.stderr


@FULL
def test_reduced_benchmark_runs_and_prints_its_table(tmp_path):
    mpiexec_or_skip()
    png = tmp_path / "engines.png"
    out = _run(["--ranks", "2", "--rows", "dp,samo", "--steps", "2", "--warmup", "0",
                "--rounds", "1", "--parity-steps", "2", "--png", str(png)], tmp_path,
               timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for peer in ("ddp-gloo", "ddp-mcrdl", "dense-gloo", "dense-mcrdl"):
        assert re.search(rf"^{peer} +\d+", text, re.M), text
    for engine, peer in (("dp", "ddp"), ("samo", "dense")):
        assert re.search(rf"^engines: {engine} \d+\.\d+x best peer \({peer}-(gloo|mcrdl)\); per "
                         r"round .*, median \d+\.\d+$",
                         text, re.M), text
    assert png.stat().st_size > 0


def test_bf16_rows_report_parity_and_mfu(tmp_path):
    """--dtype bf16 (the path --device cuda takes, here on the CPU): the dense rows against
    DDP under autocast and FSDP2 with a bf16 policy pass parity at the bf16 tolerance, and
    the table gives each contender's MFU against the measured peak."""
    mpiexec_or_skip()
    out = _run(["--ranks", "2", "--rows", "dp,4d-z", "--dtype", "bf16", "--model", "tiny",
                "--peer-backends", "gloo", "--rounds", "1", "--steps", "2", "--warmup", "0",
                "--parity-steps", "3", "--png", str(tmp_path / "bf16.png")], tmp_path,
               timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for peer in ("ddp-gloo", "fsdp2-gloo"):
        assert re.search(rf"^parity {peer}: max .*\(tolerance 0.005: bf16 .*: ok$", text,
                         re.M), text
    assert re.search(r"^tiny GPT, 2 ranks \(cpu, bf16\).*MFU against [\d.]+ TFLOP/s per rank "
                     r"\(measured cpu GEMM rate\)$", text, re.M), text
    for name in ("dp", "ddp-gloo", "4d-z", "fsdp2-gloo"):
        m = re.search(rf"^{name} +\d+ .* (\d+\.\d)%$", text, re.M)
        assert m and 0 < float(m.group(1)) < 100, text


def test_cuda_without_a_gpu_says_so(tmp_path):
    """The CPU suite's processes see no GPU (tests/conftest.py): --device cuda refuses
    at once, saying why (tests/test_gpu.py runs it on a GPU)."""
    out = _run(["--device", "cuda", "--ranks", "1"], tmp_path, timeout=120)
    assert out.returncode == 2 and "--device cuda: no GPU visible" in out.stderr, out.stderr


def test_every_row_names_workers_that_exist():
    """Each contender rows_for names, on either device and dtype at 1 to 8 ranks, is a
    worker the launched job can run (a missing one fails only when its job starts, on
    the machine the row is for)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import engines
    finally:
        sys.path.remove(str(SCRIPT.parent))
    for device, dtype in (("cpu", "fp32"), ("cpu", "bf16"), ("cuda", "bf16")):
        for ranks in (1, 2, 4, 8):
            for row in engines.rows_for(ranks, 8, 64, device, dtype):
                for name in (row.engine, *row.peers):
                    assert name in engines.WORKERS, (device, dtype, ranks, name)


def test_parity_steps_zero_is_refused(tmp_path):
    out = _run(["--ranks", "2", "--rows", "dp", "--parity-steps", "0"], tmp_path, timeout=120)
    assert out.returncode == 2 and "--parity-steps 0: expected >= 1" in out.stderr, out.stderr
