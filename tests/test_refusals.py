"""Refused runs of train_gpt and train_moe: one line per job, exit status 2 on every rank,
no traceback, before a model is built (training/core/validate.py).

The table holds a mistaken command line of every option family (batch and layout
arithmetic; heads, vocabulary and experts against the axes; layer splits; paths; dtypes;
ranges; resume without a checkpoint; SAMO; TED's capacity and router groups; a backend
this node cannot start). Every case
runs in this process through the command's ``main`` (a launch's rank 0 and rank 1 seen
through the launcher's variables: rank 0 prints the one line, rank 1 nothing; the run
itself replaced by a failure, so a case that got past the validation fails the test).
Under mpiexec, at 2 and 4 ranks, the cases the validation once missed (each launch costs
every rank its torch import: a few seconds each on a loaded machine); the whole table
with MCRDL_TEST_FULL=1. A path only some ranks see is gathered and printed once with the
ranks it concerns: mpiexec's per-rank working directories (``-wdir``) give the ranks
different file systems for a relative path."""

from __future__ import annotations

import os
import sys

import pytest

from ._launch import FULL, mpiexec_or_skip, pythonpath, run_launcher, without_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A refused launch ends in seconds; this only keeps a hang from holding the suite.
HANG_GUARD_S = 240

GPT, MOE = "train_gpt", "train_moe"

#: (command, ranks, argv, words of the message, every rank's error (else this node's
#: files)). Paths are relative to the test's working directory, which holds "afile" (a
#: file), "ckpts" (an empty directory) and "w.pt" (an empty file).
CASES = [
    # batch and layout arithmetic
    (GPT, 4, ["--G-z", "2", "--G-data", "2", "--micro-batch-size", "16",
              "--global-batch-size", "16"], "--global-batch-size 16 is not divisible by "
     "G_z*G_data*--micro-batch-size=2*2*16=64", True),
    (GPT, 2, ["--G-data", "2", "--micro-batch-size", "16", "--global-batch-size", "16"],
     "--global-batch-size 16 is not divisible by G_data*--micro-batch-size=2*16=32", True),
    (GPT, 2, ["--G-data", "4"], "process grid G_inter=1 x G_data=4 needs 4 ranks but the "
     "world has 2", True),
    (GPT, 4, ["--G-x", "2", "--G-z", "3", "--global-batch-size", "6"], "needs "
     "G_x*G_y*G_z*G_data=6 ranks but the world has 4", True),
    (MOE, 4, ["--G-expert", "4", "--global-batch-size", "6"], "--global-batch-size 6 is not "
     "divisible by G_data=4: every data shard takes whole microbatches of "
     "--micro-batch-size 2; choose a multiple of 8", True),
    (MOE, 4, ["--G-tensor", "2", "--G-data", "4"], "G_tensor=2 x G_data_nonexp=4 = 8 ranks, "
     "but the world has 4", True),
    (MOE, 2, ["--G-expert", "2", "--G-data", "3"], "G_data_nonexp=3 is not divisible by "
     "G_expert=2", True),
    # heads, vocabulary and experts against the axes
    (GPT, 4, ["--G-x", "4"], "n_head=2 is not divisible by G_x=4", True),
    (GPT, 2, ["--G-y", "2", "--n-embd", "33", "--n-head", "3"],
     "n_embd=33 is not divisible by G_y=2", True),
    (GPT, 3, ["--G-x", "3", "--n-head", "3", "--n-embd", "48", "--global-batch-size", "6"],
     "vocab_size=256 is not divisible by G_x=3", True),
    (MOE, 4, ["--experts", "3", "--G-expert", "2"], "experts=3 is not divisible by "
     "G_expert=2", True),
    (MOE, 2, ["--G-tensor", "2", "--n-head", "3", "--n-embd", "48"], "n_head=3 is not "
     "divisible by G_tensor=2", True),
    (GPT, 2, ["--n-head", "3"], "--model tiny --n-head 3: n_embd=32 is not divisible by "
     "n_head=3", True),
    (GPT, 2, ["--model", "gpt9"], "--model gpt9: unknown gpt model 'gpt9'", True),
    # layer splits
    (GPT, 2, ["--G-inter", "2", "--layers-per-stage", "3,3"], "--layers-per-stage 3,3 "
     "places 6 transformer blocks but the model has 4", True),
    (GPT, 2, ["--G-inter", "2", "--layers-per-stage", "4"], "--layers-per-stage 4 has 1 "
     "entry for --G-inter 2", True),
    (GPT, 4, ["--G-inter", "4", "--n-layer", "3"], "--G-inter 4: the model has 3 transformer "
     "blocks", True),
    (MOE, 2, ["--moe-every", "5"], "--moe-every=5 with --n-layer=2: no block has experts",
     True),
    # paths (this node's files)
    (GPT, 2, ["--G-data", "2", "--checkpoint-dir", "afile"], "--checkpoint-dir afile is a "
     "file; expected a directory", False),
    (GPT, 2, ["--G-data", "2", "--init-from", "missing.pt"], "--init-from missing.pt: no "
     "such file", False),
    (MOE, 2, ["--out-dir", "afile/run"], "--out-dir afile/run is inside the file", False),
    (GPT, 2, ["--G-data", "2", "--data", "no-tokens"], "--data no-tokens is no directory",
     False),
    (GPT, 2, ["--G-data", "2", "--data", "tokens", "--vocab-size", "64"], "--data tokens: "
     "train.bin holds 20 tokens; expected more than block_size + 1 = 33", False),
    (GPT, 2, ["--G-data", "2", "--backends", "rccl"], "--backends 'rccl': backend 'rccl' "
     "is unavailable here", False),
    # resume without a checkpoint
    (GPT, 2, ["--G-data", "2", "--checkpoint-dir", "ckpts", "--resume"], "--resume: no "
     "complete checkpoint in --checkpoint-dir ckpts", False),
    (MOE, 2, ["--resume", "ckpts/step_00000009"], "--resume ckpts/step_00000009: no such "
     "checkpoint directory", False),
    (GPT, 2, ["--G-data", "2", "--resume"], "--resume without a path needs "
     "--checkpoint-dir", True),
    # dtypes
    (GPT, 2, ["--G-data", "2", "--dtype", "fp12"], "--dtype 'fp12': expected one of", True),
    (GPT, 2, ["--G-x", "2", "--dtype", "fp16"], "--dtype fp16 is not supported by the 4D "
     "engine", True),
    (MOE, 2, ["--dtype", "float16"], "--dtype fp16: train_moe has no loss scaling", True),
    # ranges
    (GPT, 2, ["--G-data", "2", "--lr", "-1"], "--lr is -1.0; expected > 0", True),
    (MOE, 2, ["--steps", "0"], "--steps is 0; expected a positive integer", True),
    (GPT, 2, ["--G-data", "2", "--stop-after", "30"], "--stop-after 30: expected 1..--steps",
     True),
    # SAMO
    (GPT, 2, ["--G-data", "2", "--prune-sparsity", "1.5"], "--prune-sparsity 1.5: expected "
     "a fraction in [0, 1)", True),
    (GPT, 2, ["--G-data", "2", "--samo"], "--samo needs --prune-sparsity", True),
    (GPT, 2, ["--G-data", "2", "--prune-sparsity", "0.5", "--prune-schedule", "0,40"],
     "--prune-schedule '0,40': a round before step 40 never runs", True),
    # TED's capacity and router groups
    (MOE, 2, ["--capacity-factor", "0.01"], "expert capacity 0.04 < 1 token", True),
    (MOE, 2, ["--router-group-tokens", "7"], "--router-group-tokens 7 does not divide a "
     "microbatch's 32 tokens", True),
]

#: The cases run under mpiexec by default, of those a launch once printed as tracebacks
#: from every rank or as one copy per rank: the 4D batch and the experts at 4 ranks, a
#: missing --init-from at 2 (every rank's copy of a path error, gathered into one).
LAUNCHED = {0, 10, 19}


def _id(case) -> str:
    command, ranks, argv = case[:3]
    return f"{command}-{ranks}-{' '.join(argv)}"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "w.pt").write_text("")
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "train.bin").write_bytes(bytes(40))  # 20 uint16 tokens
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _main(command: str):
    from training import train_gpt, train_moe
    return {GPT: train_gpt, MOE: train_moe}[command]


def _with_out_dir(argv: list[str]) -> list[str]:
    return argv if "--out-dir" in argv else [*argv, "--out-dir", "out"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_refused_in_process(case, workdir, monkeypatch, capsys):
    """Every rank's errors: exit status 2 on each rank, the one line from the launch's
    rank 0, naming the option, and no run. This node's files: the error the ranks
    gather (runner.LOCAL_ERRORS; the launches below check the gathering)."""
    from training.core.runner import LOCAL_ERRORS

    command, ranks, argv, words, agreed = case
    module = _main(command)
    argv = _with_out_dir(argv)
    if not agreed:
        with pytest.raises(LOCAL_ERRORS) as refused:
            module.parse_args(argv, world_size=ranks)
        assert words in str(refused.value) and "\n" not in str(refused.value)
        return

    def no_run(cfg, **kw):
        raise AssertionError(f"{argv} got past the validation")

    monkeypatch.setattr(module, "run", no_run)
    without_launcher(monkeypatch)
    monkeypatch.setenv("PMI_SIZE", str(ranks))
    for rank in ("0", "1"):
        monkeypatch.setenv("PMI_RANK", rank)
        assert module.main(argv) == 2
        err = capsys.readouterr().err
        if rank == "1":
            assert err == "", err
            continue
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert words in err, err


def _mpiexec(cmd: list[str]) -> str:
    """`cmd`'s output; it must exit 2 (mpiexec's status is its ranks' worst)."""
    env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), MCRDL_TIMEOUT="120",
               OMP_NUM_THREADS="1")
    env.pop("MCRDL_DEBUG", None)
    return run_launcher(cmd, env=env, timeout=HANG_GUARD_S, expect_rc=2)


def _assert_refused_once(out: str, line: str) -> None:
    """`line`, and no other error line, no traceback, no model (its size line)."""
    errors = [x for x in out.splitlines() if x.startswith("error")]
    assert errors == [line], out
    assert "Traceback" not in out and "M params" not in out, out


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if i in LAUNCHED else FULL)
                                  for i, c in enumerate(CASES)], ids=_id)
def test_refused_under_mpiexec(case, workdir):
    """A launch's refusal: status 2, one line, no traceback, no model built."""
    command, ranks, argv, words, _ = case
    out = _mpiexec([mpiexec_or_skip(), "-n", str(ranks), sys.executable, "-m",
                    f"training.{command}", *_with_out_dir(argv)])
    lines = [x for x in out.splitlines() if x.startswith("error")]
    assert len(lines) == 1 and words in lines[0], out
    _assert_refused_once(out, lines[0])


@pytest.mark.parametrize("ranks,argv,line", [
    (4, ["--init-from", "w.pt"], "error (ranks 2, 3 of 4): --init-from w.pt: no such file; "
                                 "expected a serial state_dict (.pt) or hf:DIR"),
    pytest.param(2, ["--config", "run.json"], "error (rank 1 of 2): --lr is -1; expected > 0",
                 marks=FULL)])
def test_refusal_of_some_ranks_is_gathered(ranks, argv, line, workdir):
    """Ranks in two working directories (nodes with their own files): the first half
    has w.pt and a good run.json, the second half neither w.pt nor that file's
    --lr. The refusal is printed once, with the ranks it concerns, every rank exits 2."""
    here, there = workdir / "node_a", workdir / "node_b"
    for d in (here, there):
        d.mkdir()
    (here / "w.pt").write_text("")
    (here / "run.json").write_text('{"steps": 1}')
    (there / "run.json").write_text('{"steps": 1, "lr": -1}')
    half = ranks // 2
    command = [sys.executable, "-m", "training.train_gpt", "--G-data", str(ranks), *argv,
               "--out-dir", str(workdir / "out")]
    out = _mpiexec([mpiexec_or_skip(), "-n", str(half), "-wdir", str(here), *command,
                    ":", "-n", str(half), "-wdir", str(there), *command])
    _assert_refused_once(out, line)


def test_debug_keeps_the_traceback(workdir, monkeypatch, capsys):
    """MCRDL_DEBUG=1: the refusal keeps its traceback (developers)."""
    from training import train_gpt
    without_launcher(monkeypatch)
    monkeypatch.setenv("MCRDL_DEBUG", "1")
    assert train_gpt.main(["--G-inter", "2", "--layers-per-stage", "3,3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "in check_model" in err, err
    assert err.splitlines()[-1].startswith("error: --layers-per-stage 3,3 places 6"), err


def test_ranks_are_named_compactly():
    from training.core.validate import describe_ranks, refusal_lines
    assert describe_ranks([3], 8) == "rank 3 of 8"
    assert describe_ranks([3, 7], 8) == "ranks 3, 7 of 8"
    assert describe_ranks([*range(512), 700, 701], 1024) == "ranks 0-511, 700, 701 of 1024"
    assert refusal_lines([None, "a", "b", "a"]) == ["error (ranks 1, 3 of 4): a",
                                                   "error (rank 2 of 4): b"]
    assert refusal_lines(["a", "a"]) == ["error: a"]
    assert refusal_lines([None, None]) == []
