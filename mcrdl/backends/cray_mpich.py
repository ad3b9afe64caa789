"""The "cray-mpich" backend: the MPI backend specialised for Cray MPICH (HPE Slingshot
systems such as Frontier and Perlmutter).

It is the "mpi" backend's hot path (mcrdl._C.MpiComm) on a communicator of its own,
usable only when the MPI library mpi4py loaded identifies itself as Cray MPICH. What it
adds are the library settings the MCR-DL and PCCL papers run with, checked at init:

- ``MPICH_GPU_SUPPORT_ENABLED=1``: GPU-aware transfers (required for GPU buffers; mcrdl
  still stages GPU tensors through the caller unless the library is GPU-aware).
- ``MPICH_OFI_NIC_POLICY=GPU`` (or ``NUMA``): each rank uses the NIC nearest its GPU
  instead of funnelling a node's traffic through one NIC (the PCCL paper's finding).
- ``MPICH_SMP_SINGLE_COPY_MODE=CMA`` is left to the site.

These variables are read by MPI_Init, which has already run when mcrdl initializes, so
the backend cannot change them: it warns, once, naming each missing setting and the
value to export in the job script. :func:`recommended_env` returns them.
"""

from __future__ import annotations

import logging
import os

from .mpi import MPIBackend

log = logging.getLogger("mcrdl")

RECOMMENDED_ENV = {
    "MPICH_GPU_SUPPORT_ENABLED": ("1",),
    "MPICH_OFI_NIC_POLICY": ("GPU", "NUMA"),
}


def is_cray_mpich(version: str) -> bool:
    """Whether an MPI library version string is Cray MPICH's."""
    return "cray mpich" in version.lower() or "cray-mpich" in version.lower()


def recommended_env(environ=None) -> dict[str, str]:
    """Settings of RECOMMENDED_ENV missing from `environ` -> the value to export."""
    environ = os.environ if environ is None else environ
    return {k: v[0] for k, v in RECOMMENDED_ENV.items() if environ.get(k) not in v}


class CrayMPICHBackend(MPIBackend):
    name = "cray-mpich"

    @classmethod
    def availability(cls, launch) -> str | None:
        why = super().availability(launch)
        if why is not None:
            return why
        try:
            from ..bootstrap import mpi_module

            version = mpi_module().Get_library_version()
        except Exception as exc:  # mpi4py present but its MPI does not load
            return f"the MPI library does not load: {exc}"
        if not is_cray_mpich(version):
            first = " ".join(version.strip().splitlines()[0].split()) if version.strip() else "?"
            return (f"the MPI library is not Cray MPICH ({first.strip()}); use backend 'mpi' "
                    "(on a Cray system, load cray-mpich and rebuild mcrdl against it)")
        return None

    def __init__(self, ctx):
        super().__init__(ctx)
        missing = recommended_env()
        if missing and ctx.bootstrap.rank == 0:
            log.warning("mcrdl: cray-mpich runs best with %s exported before the job starts "
                        "(MPI_Init reads them)",
                        ", ".join(f"{k}={v}" for k, v in missing.items()))
