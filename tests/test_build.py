"""The build of mcrdl's C++ core: what the linked module exposes to the process.

The module (mcrdl._C) shares its process with torch's libraries, which use the shared C++
runtime (libstdc++.so). Where a compiler links its C++ runtime statically (a GCC built
without a shared libstdc++, or with -static-libstdc++ in its specs, as some CUDA
container images' GCC does), that copy must stay private to the module (setup.py links with
--exclude-libs,ALL). Exported, its symbols bind half to torch's runtime and half to the
copy, the two copies' locale facet ids disagree, and formatting a number in an
ostringstream then calls the wrong facet: the CommTimeoutError text stopped at its first
number, or the process died of SIGSEGV.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from mcrdl import _C

from ._launch import FULL

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Definitions only a C++ runtime itself holds (no header instantiates them in a module):
# exception handling, std::locale, and the locale facets' ids (std::num_put<...>::id and
# the like: the ids the two copies disagreed on).
RUNTIME_MARKS = ("__cxa_throw", "__cxa_begin_catch", "__gxx_personality_v0")
RUNTIME_PREFIXES = ("_ZNSt6locale", "_ZNKSt6locale")


def is_runtime_symbol(name: str) -> bool:
    return (name in RUNTIME_MARKS or name.startswith(RUNTIME_PREFIXES)
            or (name.startswith("_ZNSt") and name.endswith("2idE")))


def exported_runtime_symbols(so: str) -> list[str]:
    """The C++ runtime's own definitions among the dynamic symbols `so` exports."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    out = subprocess.run([nm, "-D", "--defined-only", so], capture_output=True, text=True,
                         check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    return [n for n in names if is_runtime_symbol(n)]


TIMEOUT_TEXT_PROBE = ("from mcrdl import _C; "
                      "print(_C.timeout_message('all_reduce', 'mpi', 'world', 7, 0.5))")


def check_timeout_text(text: str) -> None:
    assert "(group world, sequence number 7) did not complete within 0.5 s;" in text, text
    assert text.rstrip().endswith("issue the same calls)"), text


def test_module_keeps_any_cxx_runtime_private():
    """Where the toolchain links libstdc++ as a shared library (CI's), there is nothing to
    leak and this passes with or without --exclude-libs; the test below checks the flag
    on any toolchain with a static libstdc++, the FULL one on the module itself."""
    leaked = exported_runtime_symbols(_C.__file__)
    assert not leaked, (f"{_C.__file__} exports the C++ runtime's own symbols "
                        f"({leaked[:5]}...): it was linked without --exclude-libs,ALL")


def test_numbers_format_in_the_module():
    check_timeout_text(_C.timeout_message("all_reduce", "mpi", "world", 7, 0.5))


# setup.py's own Extension, read without building (setuptools.setup only records it)
SETUP_LINK_ARGS_PROBE = (
    "import json, runpy, sys, setuptools\n"
    "kw = {}\n"
    "setuptools.setup = lambda **a: kw.update(a)\n"
    "sys.argv = ['setup.py', '--version']\n"
    "runpy.run_path('setup.py', run_name='__main__')\n"
    "print(json.dumps(kw['ext_modules'][0].extra_link_args))\n")

# A module that formats a number (the locale facets the two runtimes disagreed on)
TINY_MODULE = """#include <sstream>
#include <string>
extern "C" __attribute__((visibility("default"))) int format_number(double x, char* buf,
                                                                    int n) {
    std::ostringstream out;
    out << x;
    return static_cast<int>(out.str().copy(buf, n - 1));
}
"""


def static_cxx_archive(cxx: str) -> str:
    """Path of the compiler's static libstdc++ (skip without one)."""
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(archive) or not os.path.exists(archive):
        pytest.skip(f"{cxx} has no static libstdc++ (libstdc++.a) to link")
    return archive


def test_setup_link_arguments_keep_a_static_cxx_runtime_private(tmp_path):
    """setup.py's link arguments keep a statically linked C++ runtime private: a tiny
    module linked with -static-libstdc++ and them exports none of the runtime, where the
    same link without them exports it (so the check can fail on this toolchain). Seconds,
    where building the module so (below, FULL) takes minutes; CI's toolchain links
    libstdc++ shared, so this is its check of --exclude-libs,ALL."""
    cxx = os.environ.get("CXX", "g++")
    static_cxx_archive(cxx)
    probe = subprocess.run([sys.executable, "-c", SETUP_LINK_ARGS_PROBE], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    link = json.loads(probe.stdout.splitlines()[-1])
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_MODULE)
    base = [cxx, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-static-libstdc++",
            str(src)]
    exported = {}
    for name, args in (("bare", []), ("setup", link)):
        so = tmp_path / f"{name}.so"
        built = subprocess.run([*base, "-o", str(so), *args], capture_output=True,
                               text=True, timeout=300)
        assert built.returncode == 0, built.stderr[-3000:]
        exported[name] = exported_runtime_symbols(str(so))
    assert exported["bare"], ("linked bare, the static runtime exported nothing here: "
                              "this check could not fail on this toolchain")
    assert not exported["setup"], (
        f"with setup.py's link arguments {link} the module exports the C++ runtime's own "
        f"symbols ({exported['setup'][:5]}...): link with -Wl,--exclude-libs,ALL")


@FULL
def test_statically_linked_cxx_runtime_stays_private(tmp_path):
    """Builds the module as the H100 image's compiler did (static libstdc++): it must
    need no libstdc++.so, export none of the runtime, and format numbers. 2 minutes on
    2 cores."""
    cxx = os.environ.get("CXX", "g++")
    static_cxx_archive(cxx)
    src = tmp_path / "src"
    shutil.copytree(ROOT / "mcrdl", src / "mcrdl",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "setup.py", src)
    shutil.copy(ROOT / "pyproject.toml", src)
    env = dict(os.environ, LDFLAGS="-static-libstdc++", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=src, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    so = str(next((src / "mcrdl").glob("_C*.so")))
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) not found")
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
    assert "libstdc++" not in needed, "the build did not link libstdc++ statically:\n" + needed
    assert not exported_runtime_symbols(so)
    run = subprocess.run([sys.executable, "-c", TIMEOUT_TEXT_PROBE], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(src)), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    check_timeout_text(run.stdout)


def test_package_data_ships_the_tables(tmp_path):
    """What a wheel (a non-editable install) holds besides the code: the shipped tuning
    tables and their format's documentation, which "auto" finds by provenance, the
    shipped blocking-variant choices and MPICH's collective selection. setup.py's
    build_py copies exactly the package data a wheel gets (no C++ compile)."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tuning, source = tmp_path / "mcrdl" / "tuning", ROOT / "tuning_tables"
    tables = tmp_path / "mcrdl" / "tuning_tables"
    shipped = sorted(p.name for p in source.glob("*.json"))
    assert shipped, "no shipped tuning table in tuning_tables/"
    assert sorted(p.name for p in tables.glob("*.json")) == shipped
    assert (tables / "README.md").is_file()
    for name in ("mpi_blocking.json", "mpich_posix_coll.json"):
        assert (tuning / name).is_file(), name
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from mcrdl.tuning import provenance as p; "
            "assert str(p.SHIPPED_TABLES).startswith(sys.argv[1]), p.SHIPPED_TABLES; "
            "t = p.find_shipped_table(p.SHIPPED_TABLES, {'cpu_model': sys.argv[2], "
            "'gpu_model': ''}); print(t.name if t else None)")
    from mcrdl.tuning.schema import decode, read
    path = source / shipped[0]
    cpu = decode(read(path), source=str(path)).provenance["cpu_model"]
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), cpu], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == shipped[0], r.stdout + r.stderr
