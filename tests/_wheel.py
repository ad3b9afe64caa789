"""A wheel of this repository, built once per process, and a fresh venv it is installed in.

For tests of what an installed copy of mcrdl holds and does (package data, the shipped
tuning tables, typing information), as opposed to the editable checkout the rest of the
suite imports:

- ``build_wheel() -> pathlib.Path``: the wheel file. Built with ``pip wheel
  --no-build-isolation --no-deps`` (torch and mpi4py are the installed ones, as for
  the editable install) from a copy of the working tree (the files git tracks or would
  track, uncommitted changes included), so the checkout's build folder and its
  ``mcrdl/_C*.so`` are left alone. The C++ core compiles: minutes on a small machine.
- ``wheel_venv() -> pathlib.Path``: the ``python`` of a venv outside the repository
  with that wheel installed (``--no-deps``). The venv sees this interpreter's
  site-packages (``--system-site-packages``) for torch, mpi4py and numpy, but its own
  installed mcrdl comes first on its path: ``venv_env()`` gives the environment to run
  it in (no PYTHONPATH, so nothing points back at the checkout), and the first call
  checks that ``import mcrdl`` there resolves into the venv.
- ``venv_env() -> dict``: that environment (this process's, without PYTHONPATH and
  MCRDL_TUNING_TABLE).

Both are cached: every caller in one pytest process (any test module) shares one build
and one venv, made under ``$TMPDIR`` (the session's pytest folder in the suite) and
removed when the process exits. A failed build raises ``WheelBuildError`` with pip's
output; it is not retried within the process.

Whichever test calls them first pays for the build, past the suite's per-test timeout
on a loaded machine (9 minutes with six other jobs on 2 cores): mark every test that
calls them, or its module, with ``pytest.mark.timeout(TEST_TIMEOUT_S)``.
"""

from __future__ import annotations

import atexit
import functools
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 1800  # the C++ core on a busy 2-core machine takes minutes
#: The pytest timeout of a test that may be the first to call build_wheel/wheel_venv.
TEST_TIMEOUT_S = BUILD_TIMEOUT_S + 600


class WheelBuildError(RuntimeError):
    """Building or installing the wheel failed; the message holds the command's output."""


@functools.cache
def _workdir() -> pathlib.Path:
    d = pathlib.Path(tempfile.mkdtemp(prefix="mcrdl-wheel-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def _run(cmd: list[str], what: str, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    if r.returncode != 0:
        raise WheelBuildError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n"
                              f"{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return r.stdout


def _copy_tree(dest: pathlib.Path) -> None:
    """The working tree as git sees it (tracked files and untracked ones not ignored,
    without deleted ones) into ``dest``: no build outputs, no compiled module."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                  "listing the repository's files", cwd=ROOT)
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@functools.cache
def build_wheel() -> pathlib.Path:
    """The path of a wheel built from the working tree (see the module docstring)."""
    src, out = _workdir() / "src", _workdir() / "wheels"
    _copy_tree(src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
          "--no-index", "-w", str(out), str(src)], "pip wheel", cwd=_workdir())
    wheels = sorted(out.glob("mcrdl-*.whl"))
    if len(wheels) != 1:
        raise WheelBuildError(f"pip wheel left {[w.name for w in wheels]} in {out}, "
                              "expected one mcrdl wheel")
    shutil.rmtree(src, ignore_errors=True)  # the copy and its compiled objects
    return wheels[0]


def venv_env() -> dict[str, str]:
    """The environment to run the venv's python in: nothing on PYTHONPATH (the checkout
    must not shadow the installed copy), no tuning table forced."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "MCRDL_TUNING_TABLE")}


@functools.cache
def wheel_venv() -> pathlib.Path:
    """The python of a fresh venv with the wheel installed (see the module docstring)."""
    wheel = build_wheel()
    venv = _workdir() / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         "making the venv")
    python = venv / "bin" / "python"
    # --ignore-installed: the editable mcrdl in the shared site-packages stays as it is
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--ignore-installed", str(wheel)], "installing the wheel",
         cwd=_workdir())
    where = _run([str(python), "-c", "import mcrdl; print(mcrdl.__file__)"],
                 "importing the installed mcrdl", cwd=_workdir(), env=venv_env()).strip()
    if not pathlib.Path(where).is_relative_to(venv):
        raise WheelBuildError(f"the venv's `import mcrdl` found {where}, not the copy "
                              f"installed in {venv}")
    return python
