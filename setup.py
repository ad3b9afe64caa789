"""Build of mcrdl and its C++ core ``mcrdl._C``.

``mcrdl._C`` links against torch (tensors) and the MPI library that mpi4py uses.
The MPI is found, in order, from ``$MCRDL_MPICC``/``$MPICC``, the ``mpicc`` beside
the running Python (the ``mpich`` wheel installs one under ``sys.prefix``), or
``mpicc`` on PATH; its ``-show`` output gives the include and link flags.

Build without isolation so torch and mpi4py are the ones installed in the
environment (see README): ``pip install --no-build-isolation -e .``.
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import find_namespace_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - build-time guidance
    raise SystemExit(
        "mcrdl's C++ core builds against torch: install it first "
        "(pip install -c constraints-cpu.txt torch), then build with "
        "pip install --no-build-isolation ."
    ) from exc


def _find_mpicc() -> str:
    for env in ("MCRDL_MPICC", "MPICC"):
        if os.environ.get(env):
            return os.environ[env]
    beside = os.path.join(sys.prefix, "bin", "mpicc")
    if os.path.exists(beside):
        return beside
    found = shutil.which("mpicc")
    if found:
        return found
    raise SystemExit(
        "mcrdl: no MPI compiler wrapper found. Install an MPI first "
        "(pip install mpich mpi4py, or load your site's MPI module), or set MPICC."
    )


def _mpi_flags() -> tuple[list[str], list[str], list[str], list[str]]:
    mpicc = _find_mpicc()
    for flag in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicc, flag], capture_output=True, text=True, check=True).stdout
            break
        except (subprocess.CalledProcessError, OSError):
            continue
    else:
        raise SystemExit(f"mcrdl: '{mpicc} -show' failed; set MPICC to a working MPI wrapper")
    inc, libdirs, libs, link = [], [], [], []
    for tok in shlex.split(out)[1:]:
        if tok.startswith("-I"):
            inc.append(tok[2:])
        elif tok.startswith("-L"):
            libdirs.append(tok[2:])
        elif tok.startswith("-l"):
            libs.append(tok[2:])
        elif tok.startswith("-Wl"):
            link.append(tok)
    for d in libdirs:  # find libmpi at run time without LD_LIBRARY_PATH
        link.append(f"-Wl,-rpath,{d}")
    return inc, libdirs, libs, link


inc, libdirs, libs, link = _mpi_flags()
sources = [os.path.join("mcrdl", "csrc", f) for f in
           ("module.cpp", "lane.cpp", "validate.cpp", "mpi_comm.cpp", "mpi_fast.cpp", "pccl.cpp",
            "fusion.cpp", "watchdog.cpp", "front.cpp", "gil.cpp")]

setup(
    # The repository's top-level tuning_tables/ (the measured tables, one per system) ships
    # inside the package as mcrdl/tuning_tables/: package_dir maps the folder there, for a
    # wheel and an editable install alike, and pyproject.toml's package-data names its
    # files. mcrdl.tuning.provenance.SHIPPED_TABLES finds it in either layout.
    packages=[*find_namespace_packages(include=["mcrdl*", "training*"]), "mcrdl.tuning_tables"],
    package_dir={"mcrdl.tuning_tables": "tuning_tables"},
    ext_modules=[
        CppExtension(
            "mcrdl._C",
            sources,
            include_dirs=inc,
            library_dirs=libdirs,
            libraries=libs,
            # Hidden visibility: the module exports PyInit__C only, and calls between its
            # own functions go direct instead of through the PLT (a stub and a GOT entry:
            # two cache lines a call on the hot path). pybind11 asks for it too.
            # No debug information unless MCRDL_DEBUG_INFO=1: Python's CFLAGS carry -g, and
            # the debug information of torch's and pybind11's templates is most of the
            # build (on 2 cores the build takes half the time without it, and the module
            # is 20x smaller).
            extra_compile_args=["-O2", "-std=c++20", "-Wno-c++20-extensions",
                                "-fvisibility=hidden",
                                "-g" if os.environ.get("MCRDL_DEBUG_INFO") == "1" else "-g0"],
            # --exclude-libs,ALL: where the compiler links its C++ runtime statically (a
            # GCC built without a shared libstdc++, or with -static-libstdc++ in its
            # specs), that copy stays private to the module. Exported, its symbols bind
            # half to the process's libstdc++.so (torch's) and half to the copy, and the
            # two copies' locale facet ids disagree: formatting a number in an
            # ostringstream then calls a codecvt facet as num_put and crashes (as in CUDA
            # container images whose GCC links libstdc++ statically). Without static
            # archives it changes nothing.
            extra_link_args=[*link, *(["-Wl,--exclude-libs,ALL"]
                                       if sys.platform.startswith("linux") else [])],
        )
    ],
    # With ninja (the README installs it) the sources compile in parallel: MAX_JOBS jobs,
    # else ninja's default of cores + 2 (each compile can take ~1 GiB: set MAX_JOBS on a
    # small machine). On 2 cores 79 s against 167 s one by one. Without ninja torch's
    # BuildExtension warns and compiles one by one; MCRDL_NINJA=0 asks for that.
    cmdclass={"build_ext": BuildExtension.with_options(
        use_ninja=os.environ.get("MCRDL_NINJA", "1") != "0")},
)
