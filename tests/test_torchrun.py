"""Gloo under torchrun (env:// rendezvous, no MPI world) at 3 ranks."""

import os
import shutil
import sys

import pytest

from ._launch import run_launcher, skip_without

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun", "run_gloo.py")


@pytest.mark.parametrize("store", ["agent", "rank 0"], ids=["agent", "rank0"])
def test_gloo_under_torchrun(store):
    """Also in debug mode, whose side channel is then a Gloo process group: the two modes
    are two init/finalize sessions of one launch, on the store of torchrun's agent and on
    one rank 0 hosts (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), both outliving a session."""
    torchrun = os.path.join(sys.prefix, "bin", "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        skip_without("torchrun not found")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA"))}
    env.update(MCRDL_TIMEOUT="60")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if store == "rank 0":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    debugs = ("0", "1") if store == "agent" else ("1", "0")
    out = run_launcher([torchrun, "--standalone", "--nproc_per_node", "3", SCRIPT,
                        ",".join(debugs)], env=env, timeout=180)
    for debug in debugs:
        for r in range(3):
            assert f"rank {r}: debug {debug}: torchrun gloo OK, {store} store" in out, out


@pytest.fixture
def store_at_master(monkeypatch) -> int:
    """MASTER_ADDR/MASTER_PORT at a free local port, no torchrun agent store: the store
    rank 0 hosts there (bootstrap._hosted, emptied for the test) is the port's."""
    import socket

    from mcrdl import bootstrap

    monkeypatch.setattr(bootstrap, "_hosted", {})  # the servers the test makes go with it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return port


def test_sessions_on_a_store_rank_0_keeps(store_at_master):
    """In one process (no launch): a store at MASTER_ADDR/MASTER_PORT that rank 0 hosts
    is kept for the next session, which reads its own object collectives, not the first
    one's; a session whose ranks do not line up times out naming the session."""
    from mcrdl import CommTimeoutError
    from mcrdl.bootstrap import Bootstrap
    from mcrdl.launch import LaunchInfo

    alone = LaunchInfo("torchrun", 0, 1, 0, 1, False)
    first = Bootstrap(alone, 5.0)
    assert first.all_gather_object("first") == ["first"]
    first.close()
    second = Bootstrap(alone, 5.0)  # the same port: rank 0's server is reused
    assert second.all_gather_object("second") == ["second"]  # not the first's value
    second.close()
    # a third session that expects a second rank (as if ranks' init calls differed)
    lonely = Bootstrap(LaunchInfo("torchrun", 0, 2, 0, 2, False), 1.0)
    with pytest.raises(CommTimeoutError, match=r"in mcrdl session \d+ of the launcher's store"
                                               r".*call mcrdl.init and mcrdl.finalize alike"):
        lonely.all_gather_object("third")


def test_object_collectives_do_not_accumulate_in_the_store(store_at_master):
    """The store (rank 0's or torchrun's agent's) lives as long as the job: each
    all_gather_object removes this rank's keys of the group's earlier object
    collectives, which every member has read by then (broadcasts' keys included)."""
    from mcrdl import bootstrap
    from mcrdl.bootstrap import Bootstrap
    from mcrdl.launch import LaunchInfo

    b = Bootstrap(LaunchInfo("torchrun", 0, 1, 0, 1, False), 5.0)
    assert b.all_gather_object(0) == [0]
    server = bootstrap._hosted[("127.0.0.1", store_at_master)]
    before = server.num_keys()
    for i in range(1, 31):
        assert b.broadcast_object(("step", i)) == ("step", i)
        assert b.all_gather_object(b"x" * 1000) == [b"x" * 1000]
    assert b.broadcast_object("last") == "last"
    # this all_gather's key replaces the first one's; the last broadcast's stays until
    # the next all_gather (or the end of the job)
    assert server.num_keys() - before == 1, (before, server.num_keys())
    b.close()
