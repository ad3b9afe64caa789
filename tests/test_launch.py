"""Launcher discovery (mcrdl.launch.detect) under each launcher's environment, and the
one-node-or-several decision the store and Gloo take from the ranks' node ids."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest

from ._launch import clean_env, mpiexec_or_skip, pythonpath, run_launcher, without_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("env, expected", [
    # MPICH's hydra
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
     ("mpi", 5, 8, 1, 4)),
    # Open MPI's mpirun
    ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     ("mpi", 6, 8, 2, 4)),
    # srun --mpi=pmi2 -n 11 over 3 nodes, no --ntasks-per-node: the third node has 3
    ({"PMI_RANK": "9", "PMI_SIZE": "11", "SLURM_PROCID": "9", "SLURM_NTASKS": "11",
      "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "4(x2),3"},
     ("mpi", 9, 11, 1, 3)),
    # the same on the first node, and with --ntasks-per-node as well
    ({"PMI_RANK": "1", "PMI_SIZE": "11", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NTASKS_PER_NODE": "4"},
     ("mpi", 1, 11, 1, 4)),
    # srun -n 2 inside a job of 8 tasks on 2 nodes: the step's tasks on this node
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4(x2)"},
     ("mpi", 1, 2, 1, 2)),
    # srun without an MPI process-management interface
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "4(x2)"},
     ("slurm", 5, 8, 1, 4)),
    # a tasks-per-node string this does not know: the per-node request, else the world
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "4[x2]", "SLURM_NTASKS_PER_NODE": "4"},
     ("slurm", 5, 8, 1, 4)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"},
     ("slurm", 5, 8, 1, 8)),
    # torchrun
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "TORCHELASTIC_RUN_ID": "x"}, ("torchrun", 3, 4, 1, 2)),
    # python script.py
    ({}, ("single", 0, 1, 0, 1)),
])
def test_detect(monkeypatch, env, expected):
    """Rank, size, local rank and local size as each launcher gives them. Under srun the
    local size comes from SLURM_TASKS_PER_NODE and SLURM_NODEID, which every job step
    has (it had read only SLURM_NTASKS_PER_NODE, set only with --ntasks-per-node, so a
    multi-node srun job looked like one node: its ranks then rendezvoused on loopback)."""
    from mcrdl.launch import detect
    without_launcher(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    info = detect()
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == expected


@pytest.mark.parametrize("env, command", [
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpiexec -n 8"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     "srun -n 8 (or mpiexec -n 8)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "srun -n 8"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun --nproc-per-node 8"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun with 8 processes in all (--nnodes x --nproc-per-node)"),
    ({}, "mpiexec -n 8"),
])
def test_launch_command(monkeypatch, env, command):
    """The errors asking for another world size name this job's launcher (a torchrun job
    was told "launch with -n 8")."""
    from mcrdl.launch import launch_command
    without_launcher(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch_command(8) == command


@pytest.mark.parametrize("spec, node, tasks", [
    ("4(x2),3", 0, 4), ("4(x2),3", 1, 4), ("4(x2),3", 2, 3), ("4(x2),3", 3, None),
    ("2,1,2(x3)", 4, 2), ("16", 0, 16), (" 8(x2) ", 1, 8),
    ("", 0, None), (None, 0, None), ("4(x2)", None, None), ("4(x2)", -1, None),
    ("4x2", 0, None), ("4(x2),", 0, None),
])
def test_slurm_tasks_on_node(spec, node, tasks):
    from mcrdl.launch import slurm_tasks_on_node
    assert slurm_tasks_on_node(spec, node) == tasks


@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("nid[008-011]", ["nid008", "nid009", "nid010", "nid011"]),
    ("node[9-11]", ["node9", "node10", "node11"]),  # no padding: widths grow
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # the last bracket fastest
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("x1000c0s[3,5]b0n0", ["x1000c0s3b0n0", "x1000c0s5b0n0"]),
    ("vm", ["vm"]),
])
def test_expand_hostlist(text, hosts):
    """Slurm's host lists (SLURM_STEP_NODELIST) as Slurm expands them."""
    from mcrdl.launch import expand_hostlist
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, fault", [
    ("node[1-", "'[' without ']'"), ("node]", "']' without '['"), ("n[[1]]", "nested"),
    ("a,,b", "an empty name"), ("n[]", "is not N or N-M"), ("n[a-b]", "is not N or N-M"),
    ("n[4-2]", "ends below its start"),
])
def test_expand_hostlist_faults(text, fault):
    from mcrdl.launch import expand_hostlist
    with pytest.raises(ValueError, match=re.escape(fault)) as err:
        expand_hostlist(text)
    assert repr(text) in str(err.value)


# srun -n 11 over node[01-02,07] (4, 4, 3 tasks), as task 9 sees it
STEP_ENV = {"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "11", "SLURM_NTASKS": "11",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "node[01-02,07]",
            "SLURM_JOB_NODELIST": "node[01-02,07]", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
            "SLURM_TASKS_PER_NODE": "4(x2),3"}


@pytest.mark.parametrize("change, expected", [
    ({}, (9, 11, 1, 2, ("node01", "node02", "node07"), (4, 4, 3), "node07")),
    # an srun of 3 tasks on 2 nodes inside a job of 3 nodes: the step's variables count
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "node[01-02]",
      "SLURM_STEP_TASKS_PER_NODE": "2,1"},
     (2, 3, 0, 1, ("node01", "node02"), (2, 1), "node02")),
    # only the job's variables (an older Slurm): the job's node list and tasks
    ({"SLURM_STEP_NODELIST": None, "SLURM_STEP_TASKS_PER_NODE": None,
      "SLURM_STEP_NUM_TASKS": None},
     (9, 11, 1, 2, ("node01", "node02", "node07"), (4, 4, 3), "node07")),
    ({"SLURM_STEP_NODELIST": "node[01-02,07"}, None),  # malformed host list
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, None),  # tasks for 2 of the 3 nodes
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, None),  # 12 tasks, not 11
    ({"SLURM_NODEID": "3"}, None),  # a fourth node of three
    ({"SLURM_PROCID": "11"}, None),
    ({"SLURM_NODEID": None}, None),
])
def test_slurm_step(monkeypatch, change, expected):
    """This task's place in its step from Slurm's variables, None where they disagree."""
    from mcrdl.launch import slurm_step
    without_launcher(monkeypatch)
    for name, value in {**STEP_ENV, **change}.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    step = slurm_step()
    got = None if step is None else (step.rank, step.size, step.local_rank, step.node,
                                     step.nodes, step.tasks_per_node, step.node_name)
    assert got == expected


class _Gathered:
    """A communicator stand-in whose allgather returns what the ranks would give."""

    def __init__(self, rank: int, values: list):
        self.rank, self.values = rank, values

    def Get_rank(self) -> int:
        return self.rank

    def allgather(self, mine):
        assert mine == self.values[self.rank], (mine, self.values)
        return self.values


def test_pccl_nodes_from_slurm(monkeypatch):
    """pccl's node of every rank is Slurm's (SLURM_NODEID of every rank), numbered in
    order of the nodes' lowest ranks: srun -n 5 --distribution=cyclic over 2 nodes."""
    from mcrdl.backends.pccl_layout import Layout, node_ids
    without_launcher(monkeypatch)
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "3,2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nodes = node_ids(_Gathered(3, [0, 1, 0, 1, 0]), 5)
    assert nodes == [0, 1, 0, 1, 0]
    assert Layout.of((0, 1, 2, 3), nodes).hierarchical
    # rank 1 of the world is node 0's: numbered by lowest rank, whatever Slurm's index
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert node_ids(_Gathered(3, [1, 1, 0, 0, 1]), 5) == [0, 0, 1, 1, 0]


def test_pccl_nodes_not_from_another_step(monkeypatch):
    """mpiexec inside an sbatch script: the ranks inherit the batch step's variables
    (task 0 of 1), which are not the world's, so pccl does not take them: it splits
    MPI's world by shared memory instead."""
    from mcrdl.backends import pccl_layout
    without_launcher(monkeypatch)
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
                        "SLURM_TASKS_PER_NODE": "1,0"}.items():
        monkeypatch.setenv(name, value)

    class Split(Exception):
        pass

    def split():
        raise Split
    monkeypatch.setattr(pccl_layout, "mpi_module", split)
    with pytest.raises(Split):  # rank 2 of 4 does not take the step of 1 task as its own
        pccl_layout.node_ids(_Gathered(2, [0, None, None, None]), 4)


# Rank 1 claims another node (its node id patched) when the argument says so; every rank
# then checks the bootstrap's decision, the store's address and a Gloo all_reduce.
TWO_NODES = textwrap.dedent("""
    import os, sys, torch
    import mcrdl, mcrdl.bootstrap
    split = sys.argv[1] == "split"
    if split and os.environ["PMI_RANK"] == "1":
        mcrdl.bootstrap.node_id = lambda: "another-node/0"
    mcrdl.init(["mpi", "gloo"])
    boot = mcrdl.api.current_runtime().bootstrap
    assert boot.single_node() is (not split), boot.single_node()
    t = torch.full((4,), float(mcrdl.get_rank() + 1))
    mcrdl.all_reduce("gloo", t)
    assert torch.equal(t, torch.full((4,), 3.0)), t
    print(f"rank {mcrdl.get_rank()} single_node={boot.single_node()} gloo ok", flush=True)
    mcrdl.finalize()
""")


def test_one_node_or_several(tmp_path):
    """The ranks decide "one node" from their node ids, not the launcher's local size:
    with a rank on another (simulated) node, the store takes this host's address and
    Gloo its default device, and Gloo still works. (One node, on loopback, is every
    other Gloo world of the suite; `python TWO_NODES one` checks its decision.)"""
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODES)
    env = dict(clean_env(), PYTHONPATH=pythonpath(ROOT))
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable, str(script), "split"],
                       env=env, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} single_node=False gloo ok" in out, out
