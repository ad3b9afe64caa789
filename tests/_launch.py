"""Helpers to launch multi-process worlds from single-process tests, with timeouts."""

from __future__ import annotations

import collections
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

# Wider sweeps (more world sizes and layouts of a check that a representative few
# already cover) run with MCRDL_TEST_FULL=1; the default run keeps CI under its time
# budget on a 2-core machine. Use as `pytest.param(..., marks=FULL)`.
FULL = pytest.mark.skipif(os.environ.get("MCRDL_TEST_FULL") != "1",
                          reason="wider sweep: run with MCRDL_TEST_FULL=1")


#: What makes GPUs visible to a process. tests/conftest.py blanks these for every process
#: the tests start, so that the CPU suite runs on the CPU also on a GPU machine (where its
#: multi-rank worlds would otherwise share one GPU, and "auto" devices and every usable
#: backend would change under its checks); tests/test_gpu.py gives its own launches the
#: session's values back (gpus_visible).
GPU_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_GPU_VALUES: dict[str, str | None] = {}


def hide_gpus() -> None:
    """Blank GPU_VARS in os.environ (for the processes started from here on), keeping the
    values they had for gpus_visible."""
    for var in GPU_VARS:
        _GPU_VALUES.setdefault(var, os.environ.get(var))
        os.environ[var] = ""


def gpus_visible() -> bool:
    """Give GPU_VARS the values they had before hide_gpus (unset where they were unset);
    False when hide_gpus has not run (nothing to give back)."""
    for var, value in _GPU_VALUES.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    return bool(_GPU_VALUES)


def pythonpath(*dirs: str) -> str:
    """PYTHONPATH for a child process: `dirs`, then this process's PYTHONPATH (which
    tests/conftest.py starts with tests/_site, so the child's exit stays quick)."""
    return os.pathsep.join([*dirs, *filter(None, [os.environ.get("PYTHONPATH")])])


def skip_without(what: str) -> None:
    """Skip a test for want of `what` (a launcher), except in CI (CI=true), whose install
    provides it: there a missing launcher is a broken install, which most of the suite
    would otherwise skip past and pass."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} (CI=true: the install is expected to provide it)")
    pytest.skip(what)


def import_or_skip(module: str):
    """The imported `module`, or skip_without when it is missing (pyproject's "test" extra
    installs it): unlike pytest.importorskip, a failure under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_without(f"{module} is not installed ({exc}; pip install -e '.[test]')")


def mpiexec_or_skip() -> str:
    cand = os.path.join(sys.prefix, "bin", "mpiexec")
    path = cand if os.path.exists(cand) else shutil.which("mpiexec")
    if not path:
        skip_without("mpiexec not found (pip install mpich)")
    return path


def run_launcher(cmd: list[str], env: dict | None = None, timeout: float = 300,
                 expect_rc: int | str | None = 0) -> str:
    """Run `cmd` in its own process group; kill the group on timeout; return its output.

    Fails the test (showing the output) when the exit code differs from `expect_rc`
    ("nonzero": any failure, whatever words the launcher reports it with; None accepts
    any) or the timeout expires.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s; output:\n{out}")
    if expect_rc == "nonzero":
        if proc.returncode == 0:
            pytest.fail(f"{' '.join(cmd)} exited 0 (expected a failure); output:\n{out}")
    elif expect_rc is not None and proc.returncode != expect_rc:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} (expected {expect_rc}); "
                    f"output:\n{out}")
    return out


def run_scripts(n: int, plan: list, env: dict, timeout: float) -> str:
    """Rank scripts run in turn in one `n`-rank launch (tests/_multi.py: the ranks import
    torch once for all); `plan` lists ``[script, [args...], {env}]``. Returns the output,
    after checking that every script finished on every rank."""
    multi = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multi.py")
    out = run_launcher([mpiexec_or_skip(), "-n", str(n), sys.executable, multi],
                       env=dict(env, MCRDL_TEST_SCRIPTS=json.dumps(plan)), timeout=timeout)
    runs = collections.Counter(os.path.basename(script) for script, _, _ in plan)
    for script, times in runs.items():  # a script may run twice (other settings)
        assert out.count(f"== {script} done") == n * times, (script, out)
    return out


#: The line prefix a probe script prints its JSON result after (fresh_probe).
RESULT_MARK = "@@RESULT@@"


#: What launchers (mpiexec, srun, torchrun) set: by prefix, and by name.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCAL", "MV2_", "SLURM_",
                     "TORCHELASTIC_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


def is_launcher_variable(name: str) -> bool:
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES


def without_launcher(monkeypatch) -> None:
    """This process's environment as a plain `python` start has it (for detect())."""
    for name in list(os.environ):
        if is_launcher_variable(name):
            monkeypatch.delenv(name)


def clean_env() -> dict:
    """The environment of a plain `python` start: no launcher variables."""
    env = {k: v for k, v in os.environ.items()
           if not is_launcher_variable(k) and not k.startswith("PYTEST_")}
    env.pop("MCRDL_DEBUG", None)
    env.update(MCRDL_TIMEOUT="60", OMP_NUM_THREADS="1")
    return env


def fresh_probe(script: str, timeout: float = 240) -> dict:
    """Run `script` in a fresh interpreter (a world of one: no launcher variables) and
    return the JSON object it printed after RESULT_MARK; fail the test, with the script's
    output, on a timeout, a non-zero exit or no result line."""
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=clean_env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # its output comes as bytes (or None) here
        out, err = (b.decode(errors="replace") if isinstance(b, bytes) else b or ""
                    for b in (exc.stdout, exc.stderr))
        pytest.fail(f"the fresh-process probe script timed out:\n{out}\n{err}")
    line = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARK)]
    assert proc.returncode == 0 and line, (
        f"probe script failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}")
    return json.loads(line[0][len(RESULT_MARK):])
