"""mcrdl under a real Slurm: a one-node cluster on this machine (tests/slurm/
local_cluster.sh), jobs launched with ``srun --mpi=pmi2`` and ``sbatch``.

The MPICH wheel's libmpi speaks the simple PMI wire protocol (PMI-1), which Slurm's
mpi/pmi2 plugin serves: ``srun --mpi=pmi2`` gives it its world (``--mpi=pmix`` needs a
PMIx-enabled MPI; ``MPIR_CVAR_PMI_VERSION=2`` makes this MPICH fail to start).

Launches are few (each process pays about 2 s to import torch on a 2-core machine): the
conformance suite in one srun; discovery, the torch backend, mcrdl-bench and the
training entry points in another (tests/_multi.py); a killed rank, a raising rank, a job
that resumes a checkpoint in its second step and a job past its time limit in one each.
The time-limited job runs beside the others from the start (its limit is a minute, the
least Slurm allows, and slurmctld checks the limits every 30 s).

Skipped, with the reason, where the cluster cannot start (not root, no Slurm and no apt);
with CI=true that fails instead. The cluster is stopped after the module, unless it was
running before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ._launch import clean_env, pythonpath, run_launcher, skip_without

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CLUSTER = TESTS / "slurm" / "local_cluster.sh"
RANKS = TESTS / "slurm" / "ranks.py"
MULTI = TESTS / "_multi.py"
MPI = "--mpi=pmi2"
GPT_2X2 = ["--G-inter", "2", "--G-data", "2", "--no-plot"]
# The run past its time limit, the uninterrupted run the resumed ones must equal: 2
# stages, tiny GPT, a schedule of more steps than any run makes (--stop-after ends them)
TIME_LIMITED = ["--G-inter", "2", "--no-plot", "--steps", "100000"]


@dataclass
class Cluster:
    """The running local cluster: the environment that points Slurm's commands at it."""

    env: dict
    jobcomp: Path
    started_here: bool
    timings: dict = field(default_factory=dict)

    def srun(self, n: int, args: list, label: str, *, timeout: float = 300, expect_rc=0,
             options: tuple[str, ...] = (), env: dict | None = None) -> str:
        """`srun -n N --mpi=pmi2 OPTIONS python ARGS` (`env` added to the cluster's);
        its output. Its time is kept under `label` (printed after the module)."""
        start = time.monotonic()
        out = run_launcher(["srun", "-n", str(n), MPI, *options, sys.executable,
                            *map(str, args)], env=dict(self.env, **(env or {})),
                           timeout=timeout, expect_rc=expect_rc)
        self.timings[label] = time.monotonic() - start
        return out

    def sbatch(self, script: str, workdir: Path, options: tuple[str, ...] = ()) -> str:
        """Submit `script` (a job script's body, after its #SBATCH lines); its job id."""
        path = workdir / "job.sh"
        path.write_text("#!/bin/bash\nset -e\n" + script)
        out = subprocess.run(["sbatch", "--parsable", "-D", str(workdir), "-o",
                              str(workdir / "job.out"), *options, str(path)], env=self.env,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, f"sbatch failed: {out.stdout}{out.stderr}"
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str, timeout: float) -> dict[str, str]:
        """The finished job's record in Slurm's job completion file (JobState, ExitCode,
        ...), waiting for it at most `timeout` seconds."""
        end = time.monotonic() + timeout
        while True:
            if self.jobcomp.exists():
                for line in self.jobcomp.read_text().splitlines():
                    if line.startswith(f"JobId={job_id} "):
                        return dict(re.findall(r"(\w+)=(\S*)", line))
            if time.monotonic() > end:
                queue = subprocess.run(["squeue", "-j", job_id], env=self.env,
                                       capture_output=True, text=True, check=False)
                pytest.fail(f"job {job_id} not finished after {timeout:.0f} s: "
                            f"{queue.stdout}{queue.stderr}")
            time.sleep(0.5)


def job_processes(job_id: str) -> list[str]:
    """The processes still alive from Slurm job `job_id` (SLURM_JOB_ID in their
    environment): pid and command line."""
    found = []
    marker = f"\0SLURM_JOB_ID={job_id}\0".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in b"\0" + (proc / "environ").read_bytes():
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()!r}")
        except OSError:
            continue
    return found


def assert_no_process_left(job_id: str, timeout: float = 20) -> None:
    """Every process of the job ends (slurmstepd reaps them shortly after srun returns)."""
    end = time.monotonic() + timeout
    while (left := job_processes(job_id)) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, f"job {job_id} left processes behind: {left}"


def step_job_id(out: str) -> str:
    """The job id the ranks printed (tests/slurm/ranks.py's first line)."""
    m = re.search(r"^slurm job (\d+) step", out, re.M)
    assert m, out
    return m.group(1)


def losses(metrics: Path) -> dict[int, float]:
    """Per-step losses of a trainer's metrics file (a line cut off by a kill skipped)."""
    out = {}
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """The local cluster, started by its script (installed first where missing)."""
    if shutil.which("bash") is None:
        skip_without("local Slurm cluster: no bash to run tests/slurm/local_cluster.sh")
    running = subprocess.run([str(CLUSTER), "status"], capture_output=True, check=False)
    start = time.monotonic()
    r = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=900,
                       check=False)
    took = time.monotonic() - start
    if r.returncode != 0:
        skip_without(f"local Slurm cluster did not start (tests/slurm/local_cluster.sh "
                     f"start exited {r.returncode}): {r.stderr.strip()}")
    conf = re.search(r"export SLURM_CONF=(\S+)", r.stdout).group(1)
    env = dict(clean_env(), SLURM_CONF=conf, PYTHONPATH=pythonpath(str(ROOT)))
    c = Cluster(env, Path(conf).parent / "log" / "jobcomp.txt", running.returncode != 0)
    c.timings["cluster start"] = took
    yield c
    if c.started_here:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True, timeout=300, check=False)
    print("slurm timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in c.timings.items()))


@pytest.fixture(scope="module", autouse=True)
def time_limited(cluster, tmp_path_factory):
    """A 2-rank train_gpt job (a 2-stage pipeline) under a one-minute limit, submitted
    before the first test so that it runs beside the others (on a third of the CPU,
    against their 4 ranks), checkpointing every 2 steps, with more steps than it can
    make. Returns its job id and directory."""
    work = tmp_path_factory.mktemp("time_limit")
    args = " ".join([*TIME_LIMITED, "--checkpoint-every", "2",
                     "--checkpoint-dir", str(work / "ck"), "--metrics",
                     str(work / "killed.jsonl"), "--out-dir", str(work)])
    job = cluster.sbatch(f"srun {MPI} {sys.executable} -m training.train_gpt {args}\n",
                         work, ("-n", "2", "--time=1"))
    return job, work


@pytest.fixture(scope="module")
def world(cluster, tmp_path_factory) -> tuple[str, Path]:
    """One 4-rank srun running tests/slurm/ranks.py (discovery, torch backend),
    mcrdl-bench, train_gpt on a 2x2 pipeline (the reference run of the resumes) and on
    a 4D grid, and train_moe with TED, in turn (tests/_multi.py)."""
    work = tmp_path_factory.mktemp("world")
    bench = os.path.join(sys.prefix, "bin", "mcrdl-bench")
    if not os.path.exists(bench):
        bench = shutil.which("mcrdl-bench") or pytest.fail("mcrdl-bench is not installed")
    gpt, moe = ["module", "training.train_gpt"], ["module", "training.train_moe"]
    plan = [
        [str(RANKS), ["discovery"], {}],
        [str(RANKS), ["torch"], {}],
        [bench, ["--op", "all_reduce", "all_gather", "--backend", "mpi", "gloo",
                 "--max-bytes", "64K", "--json", str(work / "bench.json")], {}],
        [str(RANKS), [*gpt, *GPT_2X2, "--steps", "3", "--metrics",
                      str(work / "pipeline.jsonl"), "--out-dir", str(work / "pipeline")], {}],
        [str(RANKS), [*gpt, "--G-x", "2", "--G-z", "2", "--steps", "3", "--no-plot",
                      "--metrics", str(work / "grid4d.jsonl"), "--out-dir",
                      str(work / "grid4d")], {}],
        [str(RANKS), [*moe, "--G-tensor", "2", "--G-expert", "2", "--experts", "4", "--steps",
                      "3", "--no-plot", "--metrics", str(work / "ted.jsonl"), "--out-dir",
                      str(work / "ted")], {}],
    ]
    out = cluster.srun(4, [MULTI], "world", timeout=500,
                       env={"MCRDL_TEST_SCRIPTS": json.dumps(plan)})
    for script in ("ranks.py", "mcrdl-bench"):
        runs = sum(1 for s, _, _ in plan if os.path.basename(s) == script)
        assert out.count(f"== {script} done") == 4 * runs, (script, out)
    return out, work


def test_conformance_suite(cluster):
    """The multi-rank conformance suite (tests/dist) at 4 ranks on mpi and gloo, every
    rank an srun task: MPI's world from Slurm's PMI server, Gloo's store address over it."""
    out = cluster.srun(4, ["-m", "pytest", TESTS / "dist", "-p", "no:cacheprovider", "-q",
                           "-k", "not auto"], "conformance", timeout=400,
                       env={"MCRDL_DIST_TEST": "1"})
    # srun exited 0: every rank's pytest passed; rank 0 reports the count (a test made
    # for another world size skips)
    assert re.search(r"^\d+ passed(, \d+ skipped)?, \d+ deselected in ", out, re.M), out
    assert len(set(re.findall(r"\[mcrdl dist tests: rank (\d)", out))) == 4, out


def test_discovery_and_torch_backend(world):
    """Launch discovery (rank, local rank and size, this node in SLURM_STEP_NODELIST),
    pccl's nodes from Slurm's placement, and init_process_group("mcrdl") with no
    MASTER_ADDR, on every rank."""
    out, _ = world
    for r in range(4):
        assert f"rank {r}: discovery OK (node " in out, out
        assert f"rank {r}: torch OK" in out, out


def test_bench(world):
    out, work = world
    report = json.loads((work / "bench.json").read_text())
    assert report["world_size"] == 4 and not report["skipped"], report
    ops = {(r["op"], r["backend"]) for r in report["rows"]}
    assert ops == {(op, b) for op in ("all_reduce", "all_gather") for b in ("mpi", "gloo")}
    assert all(r["time_us"] > 0 for r in report["rows"])
    assert re.search(r"all_reduce .*mpi", out), out


def test_training_entry_points(world):
    """train_gpt on a 2x2 pipeline and on a 4D grid, train_moe with TED: every step
    logged with a finite loss."""
    _, work = world
    for name in ("pipeline", "grid4d", "ted"):
        got = losses(work / f"{name}.jsonl")
        assert sorted(got) == [1, 2, 3], (name, got)
        assert all(0 < v < 20 for v in got.values()), (name, got)


# The fault tests' ranks wait for the victim up to this; the step must end well before.
FAULT_TIMEOUT_S = 120


def fault_step(cluster: Cluster, kind: str, victim: int, options: tuple[str, ...]) -> tuple:
    """Run ranks.py's fault `kind` on 4 ranks; (output, job id, seconds from the first
    rank blocked to the step's end), after checking that the 3 others were blocked."""
    out = cluster.srun(4, [RANKS, kind, str(victim)], kind, timeout=2 * FAULT_TIMEOUT_S,
                       expect_rc="nonzero", options=options,
                       env={"MCRDL_TIMEOUT": str(FAULT_TIMEOUT_S)})
    ended = time.time()
    blocked = [float(t) for t in re.findall(r"^rank \d: waiting since (\S+)$", out, re.M)]
    assert len(blocked) == 3, out
    return out, step_job_id(out), ended - min(blocked)


def test_kill_ends_the_step(cluster):
    """A rank killed with SIGKILL ends the whole step (srun --kill-on-bad-exit): srun
    fails, the job's record says FAILED, no task is left, and the others did not wait
    for their timeout."""
    out, job, took = fault_step(cluster, "kill", 2, ("--kill-on-bad-exit=1",))
    assert re.search(r"task 2: Killed|signal 9", out), out
    assert cluster.job(job, timeout=30)["JobState"] == "FAILED"
    assert_no_process_left(job)
    assert took < FAULT_TIMEOUT_S / 2, f"the step ended {took:.0f} s after the kill:\n{out}"


def test_raise_ends_the_step_through_abort(cluster):
    """A rank that raises ends the step through mcrdl's excepthook (MPI_Abort, which
    Slurm's PMI server turns into the step's end), not through Slurm's kill-on-bad-exit
    (off here) nor the other ranks' timeouts."""
    out, job, took = fault_step(cluster, "raise", 1, ("--kill-on-bad-exit=0",))
    assert "RuntimeError: rank 1: the fault this test injects" in out, out
    assert "mcrdl: rank 1: RuntimeError was not caught; ending the job" in out, out
    assert cluster.job(job, timeout=30)["JobState"] == "FAILED"
    assert_no_process_left(job)
    assert took < FAULT_TIMEOUT_S / 2, f"the step ended {took:.0f} s after the raise:\n{out}"


def test_sbatch_resumes_in_a_second_step(cluster, time_limited, tmp_path):
    """A job script whose first step trains 4 steps and checkpoints, and whose second
    step resumes for 4 more: their losses equal bitwise those of the uninterrupted run
    with the same settings (the time-limited job's steps, up to its end)."""
    common = " ".join([*TIME_LIMITED, "--checkpoint-dir", str(tmp_path / "ck"),
                       "--out-dir", str(tmp_path)])
    train = f"srun {MPI} {sys.executable} -m training.train_gpt {common}"
    job = cluster.sbatch(f"{train} --stop-after 4 --metrics {tmp_path / 'first.jsonl'}\n"
                         f"{train} --resume --stop-after 8 --metrics {tmp_path / 'second.jsonl'}\n",
                         tmp_path, ("-n", "2"))
    record = cluster.job(job, timeout=300)
    log = (tmp_path / "job.out").read_text()
    assert record["JobState"] == "COMPLETED", (record, log)
    assert_no_process_left(job)
    first, second = losses(tmp_path / "first.jsonl"), losses(tmp_path / "second.jsonl")
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8], (first, second)
    cluster.job(time_limited[0], timeout=240)
    uninterrupted = losses(time_limited[1] / "killed.jsonl")
    compared = sorted(set(uninterrupted) & set(range(1, 9)))
    assert compared, f"the time-limited run logged no step: {uninterrupted}"
    assert {s: {**first, **second}[s] for s in compared} == {
        s: uninterrupted[s] for s in compared}


def test_time_limit_leaves_a_loadable_checkpoint(cluster, time_limited, tmp_path):
    """The job past its --time limit: Slurm's SIGTERM, then SIGKILL after KillWait. The
    trainer ends on SIGTERM (training/core/sigterm.py), no process is left, the last
    complete checkpoint loads, and the runs resumed from it make the killed run's losses
    bitwise (the killed run is an uninterrupted run up to its last logged step; where
    that is the last checkpoint's step, the checkpoint before it is resumed too, to
    compare on the steps between them)."""
    job, work = time_limited
    record = cluster.job(job, timeout=240)
    log = (work / "job.out").read_text()
    assert record["JobState"] == "TIMEOUT", (record, log)
    assert re.search(r"^SIGTERM at step \d+: ending", log, re.M), log
    assert_no_process_left(job)
    killed = losses(work / "killed.jsonl")
    last = max(killed)
    complete = sorted(int(p.parent.name.split("_")[1])
                      for p in (work / "ck").glob("step_*/manifest.json"))
    assert complete and complete[-1] <= last, (complete, last, log)
    starts = [complete[-1]] + ([complete[-2]] if complete[-1] == last and len(complete) > 1
                               else [])
    plan = []
    for c in starts:
        stop = max(last, c + 1)
        resume = ["module", "training.train_gpt", *TIME_LIMITED, "--resume",
                  str(work / "ck" / f"step_{c:06d}"), "--stop-after", str(stop),
                  "--checkpoint-dir", str(tmp_path / f"ck{c}"), "--metrics",
                  str(tmp_path / f"from{c}.jsonl"), "--out-dir", str(tmp_path)]
        plan.append([str(RANKS), resume, {}])
    cluster.srun(2, [MULTI], "time limit: resume", env={"MCRDL_TEST_SCRIPTS": json.dumps(plan)})
    compared = 0
    for c in starts:
        resumed = losses(tmp_path / f"from{c}.jsonl")
        assert min(resumed) == c + 1, (c, resumed)
        overlap = sorted(set(resumed) & set(killed))
        assert all(resumed[s] == killed[s] for s in overlap), (c, resumed, killed)
        compared += len(overlap)
    assert compared, (starts, last)
