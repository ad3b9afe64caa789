"""The mpi backend's blocking MPI path: the variant choice, and its timeout
contract (a watchdog ends the job with MPI_Abort, printing the CommTimeoutError text)."""

import json
import os
import re
import shutil
import sys
import time

import pytest

from mcrdl import _C
from mcrdl.backends import mpi
from mcrdl.tuning.schema import op_variants

from ._launch import mpiexec_or_skip, run_launcher, run_scripts
from .test_mixing import _left_behind

HERE = os.path.join(os.path.dirname(__file__), "mixing")


# Rank scripts of the 2-rank tests below that share one launch (tests/_multi.py runs
# them in turn in each rank's process; the GIL check first, since it wants a process
# without other threads, and the watchdog text last, since its finalize abandons a recv).
WATCHDOG_TEXT = r"""
import time, torch, mcrdl
from mcrdl import _C
mcrdl.init(['mpi'], timeout=2)
if mcrdl.get_rank() == 1:
    w = mcrdl.recv('mpi', torch.empty(1), src=0, tag=7, async_op=True)
    try:
        w.wait(timeout=0.25)
    except mcrdl.CommTimeoutError as e:
        assert str(e) == _C.timeout_message('recv', 'mpi', 'world', w.seq, 0.25, 2.0), e
        assert 'still in flight' in str(e), e
        print('texts agree:', e)
mcrdl.barrier('mpi')
mcrdl.finalize()
"""

ANOTHER_THREAD = r"""
import os, threading, time
import numpy as np
import mcrdl
from mcrdl.bootstrap import mpi_module
mcrdl.init(['mpi'])
MPI = mpi_module()
x, y = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
rank, n = x.Get_rank(), x.Get_size()
one = np.ones(1, np.float32)
for _ in range(20):  # past MPICH's first calls, which never take the shared-memory path
    x.Allreduce(MPI.IN_PLACE, one.copy())
got = {}
def inside():
    v = np.ones(1, np.float32)
    x.Allreduce(MPI.IN_PLACE, v)
    got['x'] = float(v[0])
if rank == 0:
    t = threading.Thread(target=inside)
    t.start()
    time.sleep(0.3)
    y.Send(np.array([42], np.int32), dest=1, tag=5)
    t.join()
else:
    m = np.zeros(1, np.int32)
    y.Recv(m, source=0, tag=5)
    assert m[0] == 42
    inside()
assert got['x'] == n, got
N, bad = 3000, []
def blocking():
    for i in range(N):
        v = np.array([rank + i], np.float32)
        x.Allreduce(MPI.IN_PLACE, v)
        if v[0] != sum(r + i for r in range(n)):
            bad.append(('blocking', i, float(v[0])))
t = threading.Thread(target=blocking)
t.start()
for i in range(N):
    v, w = np.array([3 * rank + i], np.float32), np.zeros(1, np.float32)
    req = y.Iallreduce(v, w)
    while not req.Test():
        pass
    if w[0] != sum(3 * r + i for r in range(n)):
        bad.append(('nonblocking', i, float(w[0])))
t.join()
assert not bad, bad[:5]
x.Free(); y.Free()
os.write(1, f'rank {rank} ok\n'.encode())  # one write: ranks share the pipe
mcrdl.finalize()
"""

GIL_KEPT = r"""
import os, threading, time, torch, mcrdl
from mcrdl import _C
mcrdl.init(['mpi'])
rank = mcrdl.get_rank()
seen = {'alone': _C.may_hold_gil()}
t = threading.Thread(target=time.sleep, args=(0.3,)); t.start()
seen['python thread'] = _C.may_hold_gil(); t.join()
seen['thread joined'] = _C.may_hold_gil()
# the answer is cached by the thread list's head (csrc/gil.cpp): a thread that is not the
# head ending leaves it, and the one still alive must still count
stop_a, stop_b = threading.Event(), threading.Event()
a, b = threading.Thread(target=stop_a.wait), threading.Thread(target=stop_b.wait)
a.start(); b.start()
seen['two threads'] = _C.may_hold_gil()
stop_a.set(); a.join()
seen['one of two joined'] = _C.may_hold_gil()
stop_b.set(); b.join()
seen['both joined'] = _C.may_hold_gil()
if rank == 1:
    w = mcrdl.recv('mpi', torch.zeros(1), src=0, tag=3, async_op=True)
    done = []
    w.add_done_callback(lambda err: done.append(err))
    seen['callback pending'] = _C.may_hold_gil()
mcrdl.all_gather_object(None)  # rank 1 looked before rank 0 sends
if rank == 0:
    mcrdl.send('mpi', torch.ones(1), dst=1, tag=3)
else:  # not waited on here: the lane thread completes it and runs the callback, which
    # leaves that thread a Python thread state (not a Python thread: still kept)
    deadline = time.monotonic() + 10
    while not (done and _C.may_hold_gil()) and time.monotonic() < deadline:
        time.sleep(0.01)
    seen['callback ran'] = (done == [None], _C.may_hold_gil())
with mcrdl.extensions(fusion=mcrdl.FusionConfig(wait_us=50000.0)):
    w = mcrdl.all_reduce('mpi', torch.ones(4), async_op=True)
    seen['fusion timer'] = _C.may_hold_gil()
    w.wait()
mcrdl.finalize()
mcrdl.init(['mpi'])
seen['next session'] = _C.may_hold_gil()
mcrdl.finalize()
os.environ['MCRDL_HOLD_GIL'] = 'never'
mcrdl.init(['mpi'])
seen['never'] = _C.may_hold_gil()
mcrdl.finalize()
os.write(1, f'SEEN {rank} {seen!r}\n'.encode())
"""

GIL_RELEASE = r"""
import os, sys, threading, time, torch, mcrdl, mcrdl.api
mcrdl.init(['mpi'], timeout=30)
rank = mcrdl.get_rank()
backend = mcrdl.api.current_runtime().backend('mpi')
for variant in ('blocking', 'nonblocking'):
    flag = os.path.join(sys.argv[1], variant)
    mcrdl.barrier('mpi')
    calls = backend.comm(None).blocking_calls
    with backend.variant('all_reduce', variant):
        if rank == 0:
            def later():
                time.sleep(0.5)  # rank 0's main thread is in the all_reduce by then
                open(flag, 'w').close()
            t = threading.Thread(target=later); t.start()
            x = torch.ones(1); mcrdl.all_reduce('mpi', x); t.join()
        else:
            while not os.path.exists(flag):
                time.sleep(0.01)
            x = torch.ones(1); mcrdl.all_reduce('mpi', x)
    assert x.item() == 2.0, x
    ran = backend.comm(None).blocking_calls - calls
    assert ran == (variant == 'blocking'), (variant, ran)
    os.write(1, f'rank {rank} {variant} ok\n'.encode())
mcrdl.finalize()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    """The output of the 2-rank launch of GIL_KEPT, GIL_RELEASE, ANOTHER_THREAD, the
    tuning table's sessions and WATCHDOG_TEXT (once for the module)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    plan = []
    for name, code, args, env in (
            ("gil_kept.py", GIL_KEPT, [], {"MCRDL_HOLD_GIL": "auto"}),
            ("gil_release.py", GIL_RELEASE, [str(tmp)], {"MCRDL_TIMEOUT": "30"}),
            ("another_thread.py", ANOTHER_THREAD, [], {})):
        (tmp / name).write_text(code)
        plan.append([str(tmp / name), args, env])
    plan.append(_table_steps_script(str(tmp)))
    # last: its finalize abandons a recv that stays posted on the old communicator
    (tmp / "watchdog_text.py").write_text(WATCHDOG_TEXT)
    plan.append([str(tmp / "watchdog_text.py"), [], {}])
    env = {k: v for k, v in os.environ.items()
           if k not in ("MCRDL_HOLD_GIL", "MCRDL_TUNING_TABLE", "MCRDL_MPI_BLOCKING",
                        "MCRDL_DEBUG")}
    return run_scripts(2, plan, env, timeout=300)


def test_blocking_mode_reads_the_environment(monkeypatch):
    monkeypatch.delenv("MCRDL_MPI_BLOCKING", raising=False)
    assert mpi.blocking_mode() == "auto"
    for mode in ("auto", "never", "always", "allreduce"):
        monkeypatch.setenv("MCRDL_MPI_BLOCKING", mode)
        assert mpi.blocking_mode() == mode
    monkeypatch.setenv("MCRDL_MPI_BLOCKING", "sometimes")
    with pytest.raises(ValueError, match="auto, never, always, allreduce.*'sometimes'"):
        mpi.blocking_mode()


def test_blocking_steps_fixed_modes_and_nearest_group_size():
    assert mpi.blocking_steps("all_reduce", 2, "always") == [(-1, True)]
    assert mpi.blocking_steps("all_reduce", 2, "never") == [(-1, False)]
    assert mpi.blocking_steps("all_gather", 2, "allreduce") == [(-1, "allreduce")]
    assert mpi.blocking_steps("reduce_scatter", 2, "allreduce") == [(-1, "allreduce")]
    assert mpi.blocking_steps("bcast", 2, "allreduce") == [(-1, True)]
    # the ops with the allreduce variant: the schema's list is the C++ communicators'
    for op in mpi.BLOCKING_OPS:
        assert _C.MpiComm.has_allreduce_variant(op) == ("allreduce" in op_variants(op)), op
    # the C++ communicators' codes; pccl's phases run "allreduce" steps blocking
    assert mpi.step_codes([(64, "allreduce"), (4096, True), (-1, False)]) == [
        (64, 2), (4096, 1), (-1, 0)]
    assert mpi.step_codes([(64, "allreduce"), (-1, False)], allreduce=False) == [
        (64, 1), (-1, 0)]
    table = {"bcast": {2: [(100, True), (-1, False)], 4: [(10, True), (-1, False)]}}
    assert mpi.blocking_steps("bcast", 3, "auto", table) == [(100, True), (-1, False)]
    assert mpi.blocking_steps("bcast", 8, "auto", table) == [(10, True), (-1, False)]
    assert mpi.blocking_steps("bcast", 1, "auto", table) == [(100, True), (-1, False)]
    shipped = mpi.shipped_blocking()
    assert set(shipped) == set(mpi.BLOCKING_OPS)
    for op in mpi.BLOCKING_OPS:  # the shipped steps are usable as they are
        for g, steps in shipped[op].items():
            sizes = [b if b >= 0 else float("inf") for b, _ in steps]
            assert sizes == sorted(set(sizes)) and sizes[-1] == float("inf"), (op, g, steps)
        assert mpi.blocking_steps("all_reduce", 2, "auto") == shipped["all_reduce"][2]
    # oversubscribed: the shipped steps give way to nonblocking; a table and "always" stay
    assert shipped["all_reduce"][2][0][1], "the shipped default has a blocking step"
    assert mpi.blocking_steps("all_reduce", 2, "auto", oversubscribed=True) == [(-1, False)]
    assert mpi.blocking_steps("bcast", 3, "auto", table, True) == [(100, True), (-1, False)]
    assert mpi.blocking_steps("bcast", 3, "always", None, True) == [(-1, True)]


def _run(n, *args, mode, timeout, done_dir):
    mpiexec = mpiexec_or_skip()
    env = dict(os.environ, MCRDL_MPI_BLOCKING=mode, TIMEOUT_DONE_DIR=str(done_dir),
               MCRDL_PCCL_INTER="mpi", MCRDL_PCCL_INTRA="mpi")
    cmd = [mpiexec, "-n", str(n), sys.executable, os.path.join(HERE, "blocking_timeout.py"),
           *map(str, args)]
    out = run_launcher(cmd, env=env, timeout=timeout, expect_rc=None)
    return out, time.time()


def test_work_wait_raises_the_watchdog_text(two_ranks):
    """The nonblocking path's CommTimeoutError text is the one the watchdog prints
    (_C.timeout_message): an async recv that nothing sends, waited with a timeout. Then
    finalize drains for the init timeout, naming that recv after 1 s, and says it
    abandoned it."""
    out = two_ranks
    assert "texts agree: recv on backend 'mpi' (group world, sequence number 1)" in out, out
    assert "did not complete within 2 s; a rank of the group may never" in _C.timeout_message(
        "recv", "mpi", "world", 1, 2.0, 2.0)  # the op's own timeout: the watchdog's text
    why, recv = "mcrdl: the 'mpi' backend was finalized", "recv (group world, sequence number 1)"
    assert (f"{why}: waiting up to 1 s more for 1 op still in flight on lane 'mpi': {recv} "
            "(a rank may never post its side)") in out, out
    assert f"{why}: abandoned 1 op that did not complete: {recv}" in out, out
    assert out.count("mcrdl: the 'mpi' backend") == 2, out  # rank 0 had nothing in flight


@pytest.mark.parametrize("backend", ["mpi", "pccl"])
def test_blocking_call_past_timeout_ends_the_job(backend, tmp_path):
    """A rank never joins a small blocking all_reduce on the blocking path: the waiting
    rank prints the CommTimeoutError text and MPI_Abort ends the job (a ceiling of 10x
    the timeout only catches a hang); no process is left. On pccl (its "mpi" algorithm)
    the blocking collective is a phase of the all_reduce: the text names the all_reduce,
    as its nonblocking path's does."""
    limit = 2.0
    out, end = _run(2, limit, *(["pccl"] if backend == "pccl" else []), mode="always",
                    timeout=60, done_dir=tmp_path)
    called = float(re.search(r"rank 1: calling at ([\d.]+)", out).group(1))
    assert end - called < 10 * limit, (end - called, out)
    text = _C.timeout_message("all_reduce", backend, "world", 2, limit)
    assert f"mcrdl: CommTimeoutError: {text}" in out, out
    assert "MPI_Abort" in out and "rank 0: skipped" not in out and "finalized" not in out, out
    if backend == "mpi":  # a single-threaded rank kept the GIL in that call: how not to
        assert "the call kept the GIL" in out and "MCRDL_HOLD_GIL=never" in out, out
    pids = [int(p) for p in re.findall(r"rank \d: pid (\d+)", out)]
    assert len(pids) == 2, out
    assert not _left_behind(pids), out


def test_pccl_blocking_phase_gets_what_is_left_of_the_timeout(tmp_path):
    """A blocking pccl all_reduce whose first phase waited: its blocking MPI all-gather
    phase may only take the rest of the op's timeout. Rank 0 joins the first phase (the
    reduce_scatter) `late` s late and never the second: the job ends about `limit` after
    rank 1's call, not `late` + `limit` (what arming each phase with the whole timeout
    gave). The two differ by `late`; the bound lies halfway, so load may delay either
    the call or the end by late / 2 (4 s) before the check fails."""
    limit, late = 10.0, 8.0
    out, end = _run(2, limit, "pccl", f"late={late}", mode="always", timeout=60,
                    done_dir=tmp_path)
    called = float(re.search(r"rank 1: calling at ([\d.]+)", out).group(1))
    joined = float(re.search(r"rank 0: joined the first phase at ([\d.]+)", out).group(1))
    # the first phase did wait: rank 0 sleeps `late` from the end of the healthy op before,
    # which rank 1 may leave up to a scheduling slice after it
    assert joined - called >= late - 1, out
    assert end - called < limit + late / 2, (end - called, out)
    text = _C.timeout_message("all_reduce", "pccl", "world", 2, limit)
    assert f"mcrdl: CommTimeoutError: {text}" in out and "MPI_Abort" in out, out
    pids = [int(p) for p in re.findall(r"rank \d: pid (\d+)", out)]
    assert len(pids) == 2 and not _left_behind(pids), out


def test_async_call_past_timeout_still_raises(tmp_path):
    """An async op of the blocking variant (run by the communicator's issue thread) keeps
    the async contract: its wait raises CommTimeoutError, the job goes on. Its thread
    stays inside MPI, under which MPI cannot be finalized (MPICH crashed with SIGSEGV in
    its progress engine at exit): at exit that rank says so and ends the job with
    MPI_Abort."""
    limit = 2.0
    out, _ = _run(2, limit, "async", mode="always", timeout=90, done_dir=tmp_path)
    text = _C.timeout_message("all_reduce", "mpi", "world", 2, limit)
    m = re.search(r"rank 1: raised after ([\d.]+) s: CommTimeoutError: (.*)", out)
    assert m and m.group(2) == text and float(m.group(1)) < limit + 5, out
    assert "rank 0: finalized" in out and "rank 1: finalized" in out, out
    assert "mcrdl: 1 MPI call(s) still running at exit on an issue thread" in out, out
    assert "MPI_Abort" in out and "Segmentation fault" not in out, out


def test_allreduce_variant_matches_torch():
    """all_gather and reduce_scatter forced to the "allreduce" variant (3 ranks: the world
    and a sub-group of 2) give torch's results for every dtype and form
    (mixing/allreduce_variant.py), and the chosen steps come back after the block."""
    mpiexec = mpiexec_or_skip()
    env = dict(os.environ, MCRDL_MPI_BLOCKING="never", MCRDL_TIMEOUT="60")
    out = run_launcher([mpiexec, "-n", "3", sys.executable,
                        os.path.join(HERE, "allreduce_variant.py")], env=env, timeout=180)
    counts = sorted(int(c) for c in re.findall(r"rank \d: ok (\d+)", out))
    assert counts == [208, 416, 416], out


def _select(tree, coll, comm_size, nbytes, threaded, commutative=True):
    """The algorithm an MPICH collective selection tree (its JSON) picks, None where none
    matches (MPICH then runs its generic algorithms). Each level is tried in order: the
    first key whose condition holds is followed, as MPICH's csel does."""
    def holds(key):
        if key == "any" or key.endswith("=any") or key == "comm_type=intra":
            return True
        name, op, val = next((key.partition(o)[0], o, key.partition(o)[2])
                             for o in ("<=", "<", "=") if o in key)
        value = {"collective": coll, "is_multi_threaded": "yes" if threaded else "no",
                 "is_commutative": "yes" if commutative else "no",
                 "avg_msg_size": nbytes, "comm_size": comm_size}[name]
        return {"=": lambda: value == val, "<=": lambda: value <= int(val),
                "<": lambda: value < int(val)}[op]()

    node = tree
    while True:
        key = next((k for k in node if k.startswith("algorithm=") or holds(k)), None)
        if key is None:
            return None
        if key.startswith("algorithm="):
            return key.split("=", 1)[1]
        node = node[key]


def _check_structure(node, path="$"):
    """MPICH's load-time rules for a selection tree (csel.c validate_tree, its parser): an
    "algorithm=" key is its object's only key; a size or comm_size test has a following
    branch (a "=any" one last); "=any" comes last."""
    keys = list(node)
    if any(k.startswith("algorithm=") for k in keys):
        assert len(keys) == 1 and node[keys[0]] == {}, path
        return
    for i, key in enumerate(keys):
        if key.endswith("=any") or key == "any":
            assert i == len(keys) - 1, f"{path}: {key} is not last"
        elif key.split("<")[0].split("=")[0] in ("avg_msg_size", "total_msg_size",
                                                   "comm_size", "count"):
            assert i < len(keys) - 1, f"{path}: {key} has no following branch"
        _check_structure(node[key], f"{path}/{key}")


def test_shipped_mpich_selection_is_mpichs_own_up_to_measured_sizes():
    """mcrdl/tuning/mpich_posix_coll.json (handed to MPICH before MPI_Init) selects, under
    MPI_THREAD_MULTIPLE, what the MPI library's built-in shared-memory selection picks
    single-threaded, up to the measured crossovers (bootstrap.py, docs/performance.md),
    and MPICH's own multi-threaded choice (its generic algorithms) above them; single-
    threaded, exactly what MPICH picks. Compared with the JSON embedded in the libmpi this
    interpreter's MPICH ships, over 2-64 ranks a node (MPICH's shared-memory selection
    sees the node's communicator) and sizes 0 B-16 MiB around each limit."""
    import glob

    from mcrdl import bootstrap

    libs = [p for p in glob.glob(os.path.join(sys.prefix, "lib", "libmpi.so*"))
            if os.path.getsize(p) > 1 << 20]  # the library, not the linker-script stub
    if not libs:
        pytest.skip(f"no libmpi.so in {sys.prefix}/lib (pip install mpich)")
    with open(libs[0], "rb") as f:
        blob = f.read()
    at = blob.find(b'{"collective=bcast":{"comm_type=intra":{"is_multi_threaded=no"')
    if at < 0:
        pytest.skip(f"{libs[0]} embeds no MPICH POSIX selection with a thread condition")
    builtin = json.loads(blob[at:blob.index(b"\0", at)])
    with open(bootstrap.mpich_posix_coll_json()) as f:
        shipped = json.load(f)
    assert set(shipped) == set(builtin)
    # the largest size at which MPICH's shared-memory algorithm is kept under MULTIPLE
    # (per ranks a node), as measured: bcast's crossover is at 2 ranks only
    limit = {"bcast": lambda n: 16384 if n <= 2 else 1 << 40, "barrier": lambda n: 1 << 40,
             "allreduce": lambda n: 4096, "reduce": lambda n: 4096}
    _check_structure(shipped)
    sizes = sorted({0, 1, *(1 << k for k in range(25)), *(3 << k for k in range(23)),
                    4097, 16385})  # powers of two, the midpoints, past each limit
    for key in builtin:
        coll = key.split("=")[1]
        for n in (2, 3, 4, 8, 64):
            for nbytes in sizes:
                for commutative in (True, False):
                    args = (coll, n, nbytes)
                    single = _select(builtin, *args, threaded=False, commutative=commutative)
                    assert _select(shipped, *args, threaded=False,
                                   commutative=commutative) == single, args
                    want = single if nbytes <= limit[coll](n) else _select(
                        builtin, *args, threaded=True, commutative=commutative)
                    assert _select(shipped, *args, threaded=True,
                                   commutative=commutative) == want, (args, commutative)


def test_mpich_selection_variable_set_before_init_unless_the_user_did():
    from mcrdl import bootstrap

    mpiexec = mpiexec_or_skip()
    var = bootstrap.MPICH_POSIX_COLL_CVAR
    code = (f"import os, mcrdl\nmcrdl.init(['mpi'])\nprint('value:', repr(os.environ['{var}']))\n"
            "mcrdl.finalize()\n")
    env = {k: v for k, v in os.environ.items() if k != var}
    out = run_launcher([mpiexec, "-n", "1", sys.executable, "-c", code], env=env, timeout=60)
    assert f"value: {bootstrap.mpich_posix_coll_json()!r}" in out, out
    assert os.path.isfile(bootstrap.mpich_posix_coll_json())
    out = run_launcher([mpiexec, "-n", "1", sys.executable, "-c", code], env=dict(env, **{var: ""}),
                       timeout=60)
    assert "value: ''" in out, out
    # oversubscribed nodes keep MPICH's own selection (the shared-memory ones spin)
    assert bootstrap.mpich_selection_default(2, 2) == bootstrap.mpich_posix_coll_json()
    assert bootstrap.mpich_selection_default(3, 2) is None


def test_node_cores_for_ranks_counts_bound_ranks_as_spread(monkeypatch):
    """A rank bound to part of the node (a launcher's binding) counts the node's CPUs, an
    unbound one its mask; init's exchange of masks finds ranks bound to shared CPUs."""
    from mcrdl import launch

    assert launch.cpu_list_size("0-3,8,10-11\n") == 7 and launch.cpu_list_size("5") == 1
    monkeypatch.setattr(launch, "node_cpus", lambda: 16)
    monkeypatch.setattr(launch, "usable_cores", lambda: 1)  # bound to one core
    assert launch.node_cores_for_ranks() == 16
    monkeypatch.setattr(launch, "usable_cores", lambda: 16)  # unbound
    assert launch.node_cores_for_ranks() == 16
    monkeypatch.setattr(launch, "node_cpus", lambda: 4)  # the mask is the job's cpuset
    monkeypatch.setattr(launch, "usable_cores", lambda: 4)
    assert launch.node_cores_for_ranks() == 4
    a, b = 0b01, 0b10  # CPU 0, CPU 1
    assert launch.node_layout([("n0", a), ("n0", b), ("n1", a | b)]) == {
        "n0": (2, 2), "n1": (1, 2)}
    assert launch.node_layout([("n0", a), ("n0", a), ("n1", b)]) == {"n0": (2, 1), "n1": (1, 1)}
    assert bin(launch.affinity_bits()).count("1") == len(os.sched_getaffinity(0))
    from mcrdl.backends import mpi
    monkeypatch.delenv("MCRDL_POLL_SPINS", raising=False)
    monkeypatch.delenv("MCRDL_IDLE_SLEEP", raising=False)
    assert mpi.poll_spins(2, 2) == 64 and mpi.poll_spins(2, 1) == 0
    assert mpi.idle_sleep(2, 2) is False and mpi.idle_sleep(2, 1) is True


@pytest.mark.skipif(not shutil.which("taskset"), reason="needs taskset (util-linux)")
def test_bound_ranks_are_not_oversubscribed_and_shared_cpus_are():
    """2 ranks bound to a core each (mpiexec -bind-to core) keep the core-per-rank policy
    (spinning waiters, MPICH's shared-memory selection, the shipped blocking steps); 2
    ranks whose masks hold one CPU between them are oversubscribed, and init says so."""
    from mcrdl import bootstrap

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    mpiexec = mpiexec_or_skip()
    var = bootstrap.MPICH_POSIX_COLL_CVAR
    code = ("import os, mcrdl, mcrdl.api\nmcrdl.init(['mpi'])\n"
            "b = mcrdl.api.current_runtime().backend('mpi')\n"
            "print(f'rank {mcrdl.get_rank()}: cpus {sorted(os.sched_getaffinity(0))} over '"
            f"f'{{b._oversubscribed}} selection {{os.environ.get(\"{var}\", \"\")!r}} '"
            "f'blocking {b.comm(None).uses_blocking(\"all_reduce\", 8)}', flush=True)\n"
            "mcrdl.finalize()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (var, "MCRDL_MPI_BLOCKING", "MCRDL_IDLE_SLEEP", "MCRDL_POLL_SPINS")}
    sel = repr(bootstrap.mpich_posix_coll_json())
    out = run_launcher([mpiexec, "-bind-to", "core", "-n", "2", sys.executable, "-c", code],
                       env=env, timeout=60)
    masks = [set(map(int, m.split(", "))) for m in re.findall(r"cpus \[([\d, ]+)\]", out)]
    if len(masks) == 2 and masks[0] & masks[1]:
        pytest.skip(f"-bind-to core gave both ranks CPUs {masks} (one SMT core?)")
    assert len(masks) == 2, out  # each rank on a core of its own
    assert out.count(f"over False selection {sel} blocking True") == 2, out
    assert "CPU(s)" not in out, out
    # two backends on MPI settle it each; the node's first rank warns once
    code = code.replace("mcrdl.init(['mpi'])", "mcrdl.init(['mpi', 'pccl'])")
    out = run_launcher(["taskset", "-c", "0", mpiexec, "-n", "2", sys.executable, "-c", code],
                       env=env, timeout=60)
    assert out.count(f"over True selection {sel} blocking False") == 2, out
    assert "2 ranks of node" in out and var in out, out
    assert out.count("run on 1 CPU(s)") == 1, out


def test_blocking_collective_waiting_on_another_thread_of_its_rank(two_ranks):
    """With MPI initialized by mcrdl (MPI_THREAD_MULTIPLE, MPICH's shared-memory
    collectives selected), a thread waiting inside a blocking allreduce holds no lock
    that another thread of the same rank needs: rank 1 joins the allreduce only after a
    message that rank 0's main thread sends while rank 0's other thread is already
    inside it. Then both threads of each rank run blocking and nonblocking allreduces on
    two communicators at once; every result is checked against its formula."""
    out = two_ranks
    assert "rank 0 ok" in out and "rank 1 ok" in out, out


#: tuning/blocking_table.py's sessions: the variables each sets before init, and the
#: steps it expects ("shipped": mcrdl/tuning/mpi_blocking.json's)
TABLE_SESSIONS = [
    {"env": {"MCRDL_MPI_BLOCKING": "auto"},
     "expected": {"all_reduce": [[64, True], [-1, False]], "bcast": "shipped"}},
    {"env": {"MCRDL_MPI_BLOCKING": "never"}, "expected": {}},
    {"env": {"MCRDL_MPI_BLOCKING": "always", "MCRDL_DEBUG": "1"}, "expected": {}},
]


def _table_steps_script(directory: str) -> list:
    """The plan entry of test_tuning_table_steps_choose_the_blocking_path (written into
    `directory`): a table whose steps make all_reduce up to 64 B blocking, and the
    sessions that check it, in tuning/blocking_table.py."""
    from mcrdl.tuning.table import TuningTable

    t = TuningTable({"command": "test"})
    t.add("all_reduce", 2, "mpi", 8, 1e-6)
    t.set_blocking_steps("all_reduce", 2, "mpi", [(64, True), (-1, False)])
    path = os.path.join(directory, "blocking.json")
    t.save(path)
    shipped_bcast = [list(s) for s in mpi.shipped_blocking()["bcast"][2]]
    sessions = [dict(s, expected={op: shipped_bcast if steps == "shipped" else steps
                                  for op, steps in s["expected"].items()})
                for s in TABLE_SESSIONS]
    # the sessions set MCRDL_MPI_BLOCKING and MCRDL_DEBUG: listed here, so that
    # tests/_multi.py restores them after the script
    return [os.path.join(os.path.dirname(__file__), "tuning", "blocking_table.py"),
            [json.dumps(sessions)],
            {"MCRDL_TIMEOUT": "60", "MCRDL_TUNING_TABLE": path, "MCRDL_MPI_BLOCKING": "auto",
             "MCRDL_DEBUG": "0"}]


def test_tuning_table_steps_choose_the_blocking_path(two_ranks):
    """A table whose steps make all_reduce up to 64 B blocking: "mpi" and "auto" calls of
    8 B run the blocking MPI collective (MpiComm.blocking_calls), 256 B ones and bcast
    (no steps in the table) the shipped choice; MCRDL_MPI_BLOCKING=never overrides, and
    debug mode keeps the nonblocking path even under "always". Each setting is an
    init/finalize session of tuning/blocking_table.py."""
    for i in range(len(TABLE_SESSIONS)):
        assert two_ranks.count(f"session {i}: variants as expected") == 2, two_ranks


def test_ranks_with_other_variants_fail_at_init(tmp_path):
    """Two ranks with other tuning tables (then, with the same table, other
    MCRDL_MPI_BLOCKING, which would make them run other variants of the same call): init
    raises DesyncError on both, naming the setting. One launch: the second case is an
    init of its own after the first failed one is finalized."""
    from mcrdl.tuning.table import TuningTable

    paths = []
    for hi in (64, 128):
        t = TuningTable({"command": "test"})
        t.set_blocking_steps("all_reduce", 2, "mpi", [(hi, True), (-1, False)])
        paths.append(tmp_path / f"steps{hi}.json")
        t.save(paths[-1])
    # one os.write per line: both ranks write to the same pipe
    code = ("import os, mcrdl\n"
            "for differ in ('table', 'mode'):\n"
            "    if differ == 'mode':\n"
            "        os.environ.pop('MCRDL_TUNING_TABLE')\n"
            "        os.environ['MCRDL_MPI_BLOCKING'] = os.environ['MODE']\n"
            "    try:\n        mcrdl.init(['mpi'])\n        os.write(1, b'no error\\n')\n"
            "    except mcrdl.DesyncError as e:\n"
            "        os.write(1, f'{differ}: DesyncError: {e}\\n'.encode())\n"
            "    mcrdl.finalize()  # the next case starts from a fresh init\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MCRDL_TUNING_TABLE", "MCRDL_MPI_BLOCKING")}
    env["MCRDL_TIMEOUT"] = "60"
    cmd = [mpiexec_or_skip()]
    for i in range(2):
        cmd += [*([":"] if i else []), "-n", "1", "-env", "MCRDL_TUNING_TABLE", str(paths[i]),
                "-env", "MODE", ("never", "always")[i], sys.executable, "-c", code]
    out = run_launcher(cmd, env=env, timeout=120)
    assert "no error" not in out, out
    # tables: refused before any backend is made, as the tables "auto" routes by
    want = {"table": ("init: ranks [1] would route \"auto\" by another tuning table",
                      "steps64.json", "steps128.json"),
            "mode": ("init: backend 'mpi' would run other blocking variants on ranks [1]",
                     "'never'")}
    for differ, parts in want.items():
        lines = [ln for ln in out.splitlines() if ln.startswith(f"{differ}: DesyncError")]
        assert len(lines) == 2, out
        for ln in lines:
            assert all(p in ln for p in parts), out


def test_gil_kept_only_when_nothing_else_can_need_it(two_ranks):
    """MCRDL_HOLD_GIL=auto (csrc/gil.h): a blocking MPI call keeps the GIL only while the
    interpreter has no other Python thread, no Python completion callback is pending and
    no fusion timer runs; "never" always releases it. Two ranks: rank 1 holds a pending
    recv with a callback until rank 0 sends."""
    out = two_ranks
    want = {"alone": True, "python thread": False, "thread joined": True,
            "two threads": False, "one of two joined": False, "both joined": True,
            "fusion timer": False, "next session": True, "never": False}
    for rank, extra in ((0, {}), (1, {"callback pending": False, "callback ran": (True, True)})):
        line = re.search(rf"SEEN {rank} (.*)", out)
        assert line, out
        assert eval(line.group(1)) == {**want, **extra}, out  # noqa: S307 (our own repr)


def test_blocking_call_releases_the_gil_a_python_thread_needs(two_ranks):
    """Rank 1 joins a small blocking all_reduce only after a file that a Python thread of
    rank 0 writes while rank 0's main thread is inside that all_reduce: rank 0 must have
    released the GIL (it has a second Python thread), or the job would hang until the
    watchdog (blocking variant) or the deadline (nonblocking variant, polled by the
    caller) ended it. Both variants, forced in turn, in one launch."""
    out = two_ranks
    for variant in ("blocking", "nonblocking"):
        assert f"rank 0 {variant} ok" in out and f"rank 1 {variant} ok" in out, out


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
@pytest.mark.parametrize("order", ["mpi4py", "mcrdl"])
def test_async_cost_per_op_does_not_grow_with_ops_in_flight(order, mode):
    """512 small async all_reduces in flight cost per op what 32 do (within 2x), whoever
    initialized MPI and whichever variant runs them: with MPI initialized by the program
    (mpi4py.MPI imported first) and ops of the blocking variant queued on the issue
    thread, every wait of an op on that thread's turns cost the lane a test of every op in
    flight, and 512 took 2.5-8x per op what 32 took; on the nonblocking variant MPICH's
    progress engine visits every nonblocking collective in flight on each test (the
    window bounds them). A ratio over the bound is measured once more (a loaded
    machine)."""
    mpiexec = mpiexec_or_skip()
    env = dict(os.environ, MCRDL_MPI_BLOCKING=mode)
    ratios = []
    for _ in range(2):
        out = run_launcher([mpiexec, "-n", "2", sys.executable,
                            os.path.join(HERE, "inflight_cost.py"), order, "32", "512"],
                           env=env, timeout=240)
        ratios.append(float(re.search(r"ratio ([0-9.]+)", out).group(1)))
        if ratios[-1] <= 2.0:
            return
    pytest.fail(f"per-op cost at 512 in flight over 2x that at 32 ({order} first, "
                f"MCRDL_MPI_BLOCKING={mode}): ratios {ratios}; last run:\n{out}")


WINDOW = r"""
import sys, torch, mcrdl
from mcrdl import _C
mcrdl.init(['mpi'])
b = mcrdl.api.current_runtime().backend('mpi')
c, rank = b.comm(None), mcrdl.get_rank()
_C.set_mpi_window(4)
with b.variant('all_reduce', 'nonblocking'):
    ts = [torch.full((256,), float(rank + k)) for k in range(64)]
    works, seen = [], 0
    for k, t in enumerate(ts):
        works.append(mcrdl.all_reduce('mpi', t, async_op=True))
        seen = max(seen, c.in_mpi)
        if k == 31:  # a blocking call behind the queued ones, then the rest
            x = torch.full((4,), float(rank))
            mcrdl.all_reduce('mpi', x)
            assert x.tolist() == [1.0] * 4, x
    for w in works:
        w.wait()
    assert seen <= 4, seen
    assert c.in_mpi == 0, c.in_mpi
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((256,), float(1 + 2 * k))), (k, t[:4])
try:
    _C.set_mpi_window(0)
except ValueError as e:
    assert 'set_mpi_window: n must be >= 1' in str(e), e
else:
    raise AssertionError('window 0 accepted')
_C.set_mpi_window(32)
# one write: the launcher interleaves the ranks' output chunk by chunk
sys.stdout.write(f'window ok {rank} {seen}\n')
sys.stdout.flush()
mcrdl.finalize()
"""


def test_async_nonblocking_collectives_kept_within_the_window(tmp_path):
    """At most mpi_window() nonblocking collectives of a communicator are in MPI at once:
    64 async all_reduces posted against a window of 4 all complete, in order, with the
    right sums, a blocking call posted behind the queued ones included."""
    mpiexec = mpiexec_or_skip()
    script = tmp_path / "window.py"
    script.write_text(WINDOW)
    out = run_launcher([mpiexec, "-n", "2", sys.executable, str(script)], timeout=180)
    for rank in (0, 1):
        assert re.search(rf"window ok {rank} [1-4]\b", out), out


INIT_MODE = r"""
import sys, logging, io
if sys.argv[1] == 'mpi4py':
    from mpi4py import MPI
import mcrdl
log = io.StringIO()
logging.getLogger('mcrdl').addHandler(logging.StreamHandler(log))
mcrdl.init(['mpi'])
b = mcrdl.api.current_runtime().backend('mpi')
print('mode:', sorted(b.init_mode.items()))
print('warned:', log.getvalue().count('import mcrdl before mpi4py.MPI'))
print('blocking 8 B:', b.comm(None).uses_blocking('all_reduce', 8))
mcrdl.finalize()
"""


@pytest.mark.parametrize("order", ["mpi4py", "mcrdl"])
def test_mpi_imported_first_is_told_and_recorded(order, tmp_path):
    """MPICH reads its collective selection in MPI_Init: mcrdl sets it when imported, so
    a program that imports mpi4py.MPI after mcrdl keeps MPICH's shared-memory path, and one
    that imports it before is told once how to keep it (init's warning); mpi_init_mode
    reads back what MPI_Init saw."""
    mpiexec = mpiexec_or_skip()
    script = tmp_path / "init_mode.py"
    script.write_text(INIT_MODE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE",
                        "MCRDL_MPICH_SELECTION")}
    out = run_launcher([mpiexec, "-n", "1", sys.executable, str(script), order], env=env,
                       timeout=120)
    selection = "mpich" if order == "mpi4py" else "mcrdl"
    assert f"('mpich_selection', '{selection}')" in out, out
    by = "the program" if order == "mpi4py" else "mcrdl"
    assert f"('mpi_initialized_by', '{by}')" in out, out
    assert f"warned: {1 if order == 'mpi4py' else 0}" in out, out
    # without MPICH's shared-memory path the shipped steps do not hold: nonblocking
    assert f"blocking 8 B: {order == 'mcrdl'}" in out, out
