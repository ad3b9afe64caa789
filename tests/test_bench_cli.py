"""Tests of the ``mcrdl-bench`` command line (``mcrdl/bench.py``).

Single-process pytest: the two-rank run is launched with ``mpiexec -n 2`` in a
subprocess (killed with its whole process group if it outlives its timeout) and skipped
when mpiexec is not on PATH; argument errors are checked in process and through the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from mcrdl.ops import OPS
from mcrdl.tools import bench
from mcrdl.tuning import sizes

from ._launch import skip_without

MPIEXEC = shutil.which("mpiexec")
RUN_TIMEOUT_S = 300


def run_command(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv``; on timeout kill its process group (mpiexec and its ranks) and fail."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{' '.join(argv)} still running after {timeout} s; killed\n"
            f"stdout:\n{stdout}\nstderr:\n{stderr}"
        )
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def test_two_ranks_json_rows_are_sane(tmp_path):
    if MPIEXEC is None:
        skip_without("mpiexec not found on PATH")
    out = tmp_path / "bench.json"
    ops, backends = ["all_reduce", "all_gather"], ["mpi", "gloo", "auto"]
    options = "--max-bytes 4K --iters 3 --warmup 1".split()
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "mcrdl.tools.bench", *options]
    command += ["--op", *ops, "--backend", *backends, "--json", str(out)]
    result = run_command(command, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "world size 2" in result.stdout
    assert result.stdout.count("size(B)") == len(ops) * len(backends)

    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert report["skipped"] == []
    crowded = len(os.sched_getaffinity(0)) < 2  # the ranks inherit this process's mask
    assert ("# oversubscribed" in result.stdout) == crowded, result.stdout
    assert bool(report["oversubscribed"]) == crowded
    expected_sizes = [8 << k for k in range(10)]  # 8 B .. 4 KiB, factor 2
    assert expected_sizes[-1] == 4096
    factors = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": (2 - 1) / 2}
    for op in ops:
        for backend in backends:
            rows = [r for r in report["rows"] if r["op"] == op and r["backend"] == backend]
            assert [r["size_bytes"] for r in rows] == expected_sizes, (op, backend)
            for row in rows:
                assert row["dtype"] == "float32"
                assert row["count"] * 4 == row["size_bytes"]
                assert row["time_us"] > 0
                algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
                assert row["algbw_gbps"] == pytest.approx(algbw, rel=1e-9)
                assert row["busbw_gbps"] == pytest.approx(algbw * factors[op], rel=1e-9)


def test_pccl_alone_is_measured(tmp_path):
    """pccl has no barrier: alone, every op was skipped ("barrier: backend 'pccl' does not
    implement it") and the run exited 0 having measured nothing; the ranks now line up
    on another backend, as beside one that has barrier."""
    if MPIEXEC is None:
        skip_without("mpiexec not found on PATH")
    out = tmp_path / "bench.json"
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "mcrdl.tools.bench", "--max-bytes",
               "64", "--iters", "2", "--warmup", "1", "--op", "all_reduce", "--backend",
               "pccl", "--json", str(out)]
    result = run_command(command, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    report = json.loads(out.read_text())
    assert report["skipped"] == [], report["skipped"]
    rows = [r for r in report["rows"] if r["backend"] == "pccl"]
    assert [r["size_bytes"] for r in rows] == [8, 16, 32, 64], report["rows"]


def test_header_flags_ranks_that_outnumber_their_cores(tmp_path):
    """Two ranks confined to one CPU: the header says the node is oversubscribed (and
    what to run instead), and so does the JSON."""
    if MPIEXEC is None:
        skip_without("mpiexec not found on PATH")
    taskset = shutil.which("taskset")
    if taskset is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs taskset and affinity masks (Linux)")
    cpu = min(os.sched_getaffinity(0))
    out = tmp_path / "bench.json"
    command = [taskset, "-c", str(cpu), MPIEXEC, "-n", "2", sys.executable, "-m",
               "mcrdl.tools.bench", "--max-bytes", "8", "--iters", "2", "--warmup", "1",
               "--backend", "mpi", "--json", str(out)]
    result = run_command(command, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    notes = [line for line in result.stdout.splitlines() if line.startswith("# oversub")]
    assert len(notes) == 1, result.stdout
    assert "runs 2 ranks on 1 CPU(s)" in notes[0] and "mpiexec -n 1" in notes[0], notes
    header = result.stdout.split("size(B)", 1)[0]
    assert notes[0] in header  # said before the numbers
    report = json.loads(out.read_text())
    assert list(report["oversubscribed"].values()) == [{"ranks": 2, "cpus": 1}]


def test_crowded_note_names_each_crowded_node():
    assert bench.crowded_note({}) == []
    lines = bench.crowded_note({"b/boot": (8, 4), "a": (3, 2)})
    assert [line.split(" runs ")[0] for line in lines] == [
        "# oversubscribed: node a", "# oversubscribed: node b"]
    assert "8 ranks on 4 CPU(s)" in lines[1] and "mpiexec -n 4" in lines[1]


def test_bad_size_suffix_exits_nonzero_with_message():
    result = run_command([sys.executable, "-m", "mcrdl.tools.bench", "--max-bytes", "4X"],
                         timeout=120)
    assert result.returncode != 0
    assert "invalid size '4X'" in result.stderr
    assert "K, M or G" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-bytes", "12Q"], "invalid size '12Q'"),
        (["--max-bytes=-4K"], "invalid size '-4K'"),
        (["--min-bytes", "8K", "--max-bytes", "4K"], "larger than --max-bytes"),
        (["--min-bytes", "0"], "--min-bytes must be at least 1"),
        (["--factor", "1"], "--factor must be an integer >= 2"),
        (["--iters", "0"], "expected an integer >= 1"),
        (["--warmup", "-1"], "expected an integer >= 0"),
        (["--op", "all_reduse"], "invalid choice: 'all_reduse'"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--backend", "no-such-backend"], "no-such-backend not usable here"),
    ],
)
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        bench.parse_args(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("8", 8),
        ("4K", 4096),
        ("4k", 4096),
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        ("2KiB", 2048),
        ("3MB", 3 << 20),
    ],
)
def test_parse_size(text, nbytes):
    assert sizes.parse_size(text) == nbytes


def test_sizes_and_counts():
    assert sizes.size_range(8, 4096, 2) == [8 << k for k in range(10)]
    assert sizes.size_range(8, 100, 4) == [8, 32]
    # all_gather's size is its output: rounded to a multiple of n elements, at least n.
    assert bench.element_count("all_gather", 8, 4, 3) == 3
    assert bench.element_count("all_gather", 64, 4, 3) == 15
    assert bench.element_count("all_reduce", 64, 4, 3) == 16
    assert bench.element_count("barrier", 64, 4, 3) == 0
    assert OPS["all_reduce"].bus_factor(4) == pytest.approx(1.5)
    assert OPS["bcast"].bus_factor(4) == 1.0
