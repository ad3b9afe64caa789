"""Discovery of rank, size and node layout from the launcher (mpiexec, torchrun, srun)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Environment variables that mean "an MPI process manager started this process".
_MPI_MARKERS = (
    "PMI_RANK",  # MPICH hydra, Intel MPI, Cray PMI, srun --mpi=pmi2
    "PMI_FD",
    "PMIX_RANK",  # Open MPI 5, srun --mpi=pmix
    "OMPI_COMM_WORLD_RANK",  # Open MPI
    "MV2_COMM_WORLD_RANK",  # MVAPICH
    "MPI_LOCALRANKID",
)


def affinity_bits() -> int:
    """The CPUs this process may run on as a bit mask (bit i: CPU i; all online CPUs
    where the OS has no masks): compact enough to gather from every rank."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(
        os.cpu_count() or 1)
    return sum(1 << c for c in cpus)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return bin(affinity_bits()).count("1") or 1


def node_id() -> str:
    """This node's name for grouping ranks: the host name and the kernel's boot id (two
    containers or machines may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def cpu_list_size(text: str) -> int:
    """The number of CPUs in a Linux CPU list such as "0-3,8,10-11"."""
    n = 0
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
    return n


def node_cpus() -> int:
    """The CPUs this job may use on this node: the cpuset of the process's cgroup, or of
    the nearest parent that has one (a container's, a systemd slice's or a batch job's
    limit), where readable; else the online CPUs."""
    paths = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:  # this process's own cgroup: v2 ("0::/path"), v1 ("N:cpuset:/path")
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            root, name = "/sys/fs/cgroup", "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            root, name = "/sys/fs/cgroup/cpuset", "cpuset.effective_cpus"
        else:
            continue
        path = path.rstrip("/")
        while True:  # the nearest cgroup up the tree that has a cpuset file
            paths.append(f"{root}{path}/{name}")
            if not path:
                break
            path = path.rsplit("/", 1)[0]
    paths += ["/sys/fs/cgroup/cpuset.cpus.effective",  # v2, cgroup namespace root
              "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"]  # v1
    for path in paths:
        try:
            with open(path) as f:
                n = cpu_list_size(f.read())
        except (OSError, ValueError):
            continue
        if n:
            return n
    return os.cpu_count() or 1


def node_cores_for_ranks() -> int:
    """How many cores this node's ranks spread over, as one rank sees it before any
    communication: its affinity mask, unless a launcher bound it to a part of the node
    (mpiexec -bind-to core, srun --cpu-bind, Open MPI's default): binders give each rank
    cores of its own, so then all the CPUs the node lets the job use. A mask narrowed by
    something else this cannot see (taskset or numactl over the whole job, a cpuset it
    cannot read) looks the same: ranks that then share CPUs are found once the ranks can
    compare their masks (:func:`node_layout`; the mpi backend warns), too late only for
    what is chosen before MPI_Init (bootstrap.mpich_selection_default)."""
    mine, node = usable_cores(), node_cpus()
    return node if mine < node else mine


def oversubscribed(ranks: int, cpus: int) -> bool:
    """The one rule of what mcrdl calls oversubscribed: a node's `ranks` outnumber the
    `cpus` they spread over. Then waiters yield and sleep, the shipped blocking steps give
    way to nonblocking calls and MPICH's shared-memory selection is left out."""
    return ranks > cpus


def node_layout(masks: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """From every rank's (node id, affinity bit mask): per node, its ranks and the CPUs
    their masks cover together, as {node: (ranks, CPUs)} (:func:`oversubscribed` says
    which nodes are)."""
    nodes: dict[str, tuple[int, int]] = {}
    for node, mask in masks:
        n, cpus = nodes.get(node, (0, 0))
        nodes[node] = (n + 1, cpus | mask)
    return {h: (n, bin(c).count("1")) for h, (n, c) in nodes.items()}


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                continue
    return None


def slurm_tasks_on_node(spec: str | None, node: int | None) -> int | None:
    """The tasks Slurm placed on node `node` (SLURM_NODEID) from SLURM_TASKS_PER_NODE
    (`spec`: per node in node order, runs compressed, as "4(x2),3"), or None where either
    is missing or malformed. Slurm sets it for every job step, where
    SLURM_NTASKS_PER_NODE exists only under --ntasks-per-node."""
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _slurm_tasks_per_node() -> str | None:
    """SLURM_TASKS_PER_NODE of this job step: the step's own (an srun inside a larger
    allocation places fewer tasks than the job has), else the job's."""
    return os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")


def _slurm_local_size() -> int | None:
    """This node's task count under srun: the tasks it placed here, else the per-node
    count the job asked for."""
    return (slurm_tasks_on_node(_slurm_tasks_per_node(), _env_int("SLURM_NODEID"))
            or _env_int("SLURM_NTASKS_PER_NODE"))


_HOST_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm host list, in Slurm's order: "node[01-04,07]" is node01
    to node04 and node07 (a range keeps the zero padding of its lower bound),
    "a[1-2],b3" is a1, a2, b3, and "r[1-2]n[1-2]" is r1n1, r1n2, r2n1, r2n2 (the last
    bracket varies fastest). Raises ValueError, naming the fault, on a malformed list."""
    def fault(why: str) -> ValueError:
        return ValueError(f"Slurm host list {text!r}: {why} (expected names and bracketed "
                          "ranges such as 'node[01-04,07],login1')")

    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):  # split at the commas outside brackets
        if ch == "[":
            depth += 1
            if depth > 1:
                raise fault("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise fault("']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise fault("'[' without ']'")
    items.append(text[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            raise fault("an empty name")
        names = [""]
        parts = re.split(r"\[([^\]]*)\]", item)  # literal, ranges, literal, ..., literal
        for i, part in enumerate(parts):
            if i % 2 == 0:
                names = [name + part for name in names]
                continue
            numbers = []
            for bounds in part.split(","):
                m = _HOST_RANGE.fullmatch(bounds.strip())
                if not m:
                    raise fault(f"range {bounds!r} is not N or N-M")
                lo, hi = m.group(1), m.group(2) or m.group(1)
                if int(hi) < int(lo):
                    raise fault(f"range {bounds!r} ends below its start")
                numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
            names = [name + n for name in names for n in numbers]
        hosts += names
    return hosts


@dataclass(frozen=True)
class SlurmStep:
    """Where srun placed this task: its rank (SLURM_PROCID) among the step's `size`
    tasks, its node's index (SLURM_NODEID) in the step's `nodes` (SLURM_STEP_NODELIST
    expanded) and the tasks on each node (SLURM_STEP_TASKS_PER_NODE)."""

    rank: int
    size: int
    local_rank: int
    node: int
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]

    @property
    def node_name(self) -> str:
        return self.nodes[self.node]


def slurm_step() -> SlurmStep | None:
    """This process's place in its Slurm job step, from Slurm's variables; None where
    srun did not start it or the variables disagree (a malformed host list, fewer
    nodes or tasks than the indices need). An sbatch script's own process has them
    too (its step is the batch step): a process another launcher started inside a job
    (mpiexec in an sbatch script) inherits them, so callers check that the step's rank
    and size are their world's."""
    env = os.environ
    rank, size = _env_int("SLURM_PROCID"), _env_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    node, local = _env_int("SLURM_NODEID"), _env_int("SLURM_LOCALID")
    hostlist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST"))
    if None in (rank, size, node, local) or not hostlist:
        return None
    try:
        nodes = expand_hostlist(hostlist)
    except ValueError:
        return None
    spec = _slurm_tasks_per_node()
    tasks = [slurm_tasks_on_node(spec, i) for i in range(len(nodes))]
    if None in tasks or sum(tasks) != size or not (0 <= rank < size and node < len(nodes)):
        return None
    return SlurmStep(rank, size, local, node, tuple(nodes), tuple(tasks))


@dataclass(frozen=True)
class LaunchInfo:
    """How this process was started.

    ``launcher`` is one of ``"mpi"``, ``"torchrun"``, ``"slurm"``, ``"single"`` or
    ``"torch"`` (no launcher: torch.distributed gave rank, size and a store, see
    :func:`torch_given`); ``mpi_world`` tells whether an MPI world exists (MPI ops can be
    used); ``why_no_mpi`` says why not when it does not. ``store``: the torch.distributed
    store the ranks rendezvous on, where the launch came with one (``"torch"``).
    """

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    mpi_world: bool
    why_no_mpi: str = ""
    store: object = field(default=None, compare=False, repr=False)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per (possibly simulated) node: MCRDL_RANKS_PER_NODE or the launcher's."""
        rpn = _env_int("MCRDL_RANKS_PER_NODE")
        return rpn if rpn and rpn > 0 else self.local_size


def _without_mpi(launcher: str, names: tuple[str, str, str], local_size: int | None,
                 why: str) -> LaunchInfo:
    """A launch with no MPI world; `names`: the variables of rank, size and local rank;
    `local_size`: the ranks on this node where the launcher says (else all of them)."""
    rank, size, local_rank = names
    n = _env_int(size) or 1
    return LaunchInfo(launcher, _env_int(rank) or 0, n, _env_int(local_rank) or 0,
                      local_size or n, False, why)


#: The world torch.distributed described, while mcrdl initializes from it (given()).
_given: LaunchInfo | None = None


def torch_given(rank: int, size: int, store: object) -> LaunchInfo:
    """The launch of a process that no launcher started (``torch.multiprocessing.spawn``,
    a ``python`` per rank) but that torch.distributed gave its rank, the world's size and
    a store (``init_process_group(backend, rank=, world_size=)`` with env://, file://
    or ``store=``). No MPI world: MPI joins only processes an MPI launcher started.
    LOCAL_RANK and LOCAL_WORLD_SIZE are used where set; else the ranks are taken to share
    one node (what spawn makes)."""
    local_rank, local_size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    return LaunchInfo(
        "torch", rank, size, rank if local_rank is None else local_rank,
        local_size or size, False,
        "no MPI launcher started the processes (torch.distributed gave rank and world size); "
        "launch with 'mpiexec -n N' (or srun with PMI) to use MPI", store)


@contextmanager
def given(info: LaunchInfo) -> Iterator[LaunchInfo]:
    """Within the block, :func:`detect` answers `info` (a world torch described,
    :func:`torch_given`): mcrdl's init builds its runtime from it."""
    global _given
    previous, _given = _given, info
    try:
        yield info
    finally:
        _given = previous


def detect() -> LaunchInfo:
    """Inspect the environment (or the world :func:`given` holds); never initializes MPI
    or opens sockets."""
    if _given is not None:
        return _given
    env = os.environ
    has_mpi = any(m in env for m in _MPI_MARKERS)
    if has_mpi:
        rank = _env_int("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
                        "SLURM_PROCID") or 0
        size = _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE",
                        "SLURM_NTASKS") or 1
        local_rank = _env_int("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                              "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID") or 0
        local_size = (_env_int("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                               "MV2_COMM_WORLD_LOCAL_SIZE") or _slurm_local_size() or size)
        return LaunchInfo("mpi", rank, size, local_rank, local_size, True)
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return _without_mpi(
            "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE"),
            "the process was started by torchrun (RANK/WORLD_SIZE set) without an MPI world; "
            "launch with 'mpiexec -n N' (or srun with PMI) to use MPI")
    if "SLURM_PROCID" in env and (_env_int("SLURM_NTASKS") or 1) > 1:
        return _without_mpi(
            "slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), _slurm_local_size(),
            "srun started this process without an MPI process-management interface; "
            "use 'srun --mpi=pmix' (or pmi2) to use MPI")
    # A plain 'python script.py': a world of one; MPI runs as a singleton.
    return LaunchInfo("single", 0, 1, 0, 1, True)


def launch_command(ranks: int) -> str:
    """How to start `ranks` processes with the launcher that started this one (for the
    errors that ask for another world size): ``mpiexec -n 8``, ``srun -n 8``, torchrun's
    ``--nproc-per-node`` (per node: the count in all where the job spans nodes)."""
    info = detect()
    if info.launcher == "torchrun":
        if info.local_size == info.size:
            return f"torchrun --nproc-per-node {ranks}"
        return f"torchrun with {ranks} processes in all (--nnodes x --nproc-per-node)"
    if info.launcher == "slurm":
        return f"srun -n {ranks}"
    if "SLURM_PROCID" in os.environ:  # srun's, or an sbatch script's mpiexec inherited it
        return f"srun -n {ranks} (or mpiexec -n {ranks})"
    return f"mpiexec -n {ranks}"
