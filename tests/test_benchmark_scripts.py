"""Every benchmark script starts and parses its options (`--help` exits 0): a renamed
module or option they import shows here, not when someone next measures. One process
runs them all (each would pay ~2 s to import torch)."""

import pathlib
import subprocess
import sys

BENCHMARKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))

_RUN_ALL = """
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: --help did not exit")
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage" not in out.getvalue().lower():
            failed.append(f"{path}: exit {exc.code}")
    except Exception as exc:
        failed.append(f"{path}: {type(exc).__name__}: {exc}")
print("\\n".join(failed) or "all ok")
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_parses_its_options(tmp_path):
    assert BENCHMARKS
    out = subprocess.run([sys.executable, "-c", _RUN_ALL, *map(str, BENCHMARKS)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert not list(tmp_path.iterdir()), f"--help wrote files: {list(tmp_path.iterdir())}"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
