"""The 4D engine (training/parallel4d) against the serial PyTorch run, in one launch.

Run under ``mpiexec -n 8``. Every grid (G_x, G_y, G_z, G_data) of issue 18's parity list
trains 20 steps of fp32 on CPU and every step's loss is compared with the serial
reference (tests/training/reference.py) to 1e-5 relative. Grids of fewer than 8 ranks
run side by side on disjoint blocks of consecutive ranks (``ProcessGrid(world=group)``;
every rank creates every grid's groups), so that the launch pays torch's import once
per rank, not once per grid. Ranks left over in a round compute the serial references.

Tiny GPT (2 blocks, sequence 16) on a 96-token vocabulary (bytes of three of Python's
source files mod 96, so that G_x = 3 divides it). Rank 0 prints one line per run and
"4d parity OK". ``$GRIDS_4D`` ("2,1,1,1;1,2,1,1") restricts the grids, ``$ARCH_4D``
("gpt" or "llama") the family.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import typing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training import _failfast as failfast  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from tests.training.reference import bf16_loss_rtol, serial_losses  # noqa: E402
from training.core.data import TokenFile  # noqa: E402
from training.core.topology import ProcessGrid  # noqa: E402
from training.models.gpt import lm_loss  # noqa: E402
from training.parallel4d.perf_model import Grid4D, TrainingStep, call_counts  # noqa: E402
from training.parallel4d.trainer import Trainer4D  # noqa: E402
from training.train_gpt import TrainConfig  # noqa: E402

WORLD = 8
VOCAB = 96
TOL = 1e-5
#: bf16 against fp32, relative, per step: a global batch of 8 sequences of 16 tokens
#: (tests/training/reference.py bf16_loss_rtol derives it; measured: 1.5e-4)
BF16_TOL = bf16_loss_rtol(tokens=8 * 16)
#: model shapes: "h4" n_embd 32 with 4 heads, batch 8; "h3" n_embd 48 with 3 heads,
#: batch 6 (divisible by G = 3); "l4", "l3": the Llama (training/models/llama.py; its
#: tiny intermediate size 96) with grouped-query attention, 2 query heads per key/value
#: head and G_x dividing n_kv_head (tensor_parallel.layers.check_kv_heads)
SHAPES = {"h4": (dict(n_embd=32, n_head=4), 8), "h3": (dict(n_embd=48, n_head=3), 6),
          "l4": (dict(arch="llama", n_embd=32, n_head=8, n_kv_head=4), 8),
          "l3": (dict(arch="llama", n_embd=48, n_head=6, n_kv_head=3), 6)}
#: (grid, shape, options): options vary the optimizer and the micro-batching
CASES = [
    ((3, 1, 1, 1), "h3", {}), ((1, 1, 3, 1), "h3", {"offload_optimizer": True}),
    ((2, 1, 1, 1), "h4", {}), ((1, 2, 1, 1), "h4", {}), ((1, 1, 2, 1), "h4", {}),
    ((1, 1, 1, 2), "h4", {"offload_optimizer": True}),
    ((2, 2, 1, 1), "h4", {}), ((2, 1, 2, 1), "h4", {"offload_optimizer": True}),
    ((1, 2, 2, 1), "h4", {"regather_weights": True}),
    ((1, 1, 2, 2), "h4", {"micro_batch_size": 1}),
    ((4, 1, 1, 1), "h4", {}), ((1, 1, 4, 1), "h4", {}),
    ((2, 2, 2, 1), "h4", {}), ((2, 2, 1, 2), "h4", {"offload_optimizer": True}),
]
#: every grid again with the Llama ("h" -> "l"), and (x2, d2)
CASES += [(grid, "l" + shape[1:], options) for grid, shape, options in CASES] + \
    [((2, 1, 1, 2), "l4", {})]
#: grids whose fresh trainer also evaluates EVAL_WINDOWS windows before training
EVAL_GRIDS = {(2, 1, 1, 2), (1, 2, 2, 1)}
EVAL_WINDOWS = 7  # not a multiple of any grid's shards x micro-batch: the last is padded


def token_data(directory: str) -> TokenFile:
    """A nanoGPT-style token file: bytes of three of Python's source files mod VOCAB
    (read directly: scanning the whole standard library costs seconds per rank)."""
    os.makedirs(directory, exist_ok=True)
    text = b"".join(open(m.__file__, "rb").read() for m in (argparse, os, typing))
    data = np.frombuffer(text, dtype=np.uint8)
    (data % VOCAB).astype(np.uint16).tofile(os.path.join(directory, "train.bin"))
    return TokenFile(directory, VOCAB)


def config(directory: str, shape: str, steps: int, grid=(1, 1, 1, 1), **options) -> TrainConfig:
    dims, batch = SHAPES[shape]
    gx, gy, gz, gd = grid
    options.setdefault("micro_batch_size", batch // (gz * gd))
    return TrainConfig(model="tiny", n_layer=2, block_size=16, **dims, data=directory,
                       vocab_size=VOCAB, steps=steps, global_batch_size=batch, seed=7,
                       lr=3e-3, warmup_steps=3, plot=False, progress=False, quiet=True,
                       out_dir=os.path.join(directory, "out"), log_interval=10**6,
                       G_x=gx, G_y=gy, G_z=gz, G_data=gd, engine="4d", **options)


def eval_windows(dataset) -> torch.Tensor:
    """EVAL_WINDOWS windows of block_size + 1 tokens from the start of the data."""
    t = 17
    data = torch.from_numpy(np.asarray(dataset.splits["train"][:EVAL_WINDOWS * t],
                                       dtype=np.int64))
    return data.view(EVAL_WINDOWS, t)


def reference(cfg: TrainConfig, dataset) -> tuple[list[float], float]:
    """(the serial run's per-step losses, the serial initial model's mean loss on
    eval_windows in float64). The GPT's run is tests/training/reference.py's; the
    Llama's the same loop (torch.optim.AdamW, clip_grad_norm_, whole global batch)."""
    from tests.training.reference import torch_adamw, torch_step
    from training.core.data import Batches
    from training.models.families import family_of, model_shape
    mcfg = model_shape(cfg, dataset.vocab_size)
    torch.manual_seed(cfg.seed)
    model = family_of(mcfg).stage(mcfg, 0, mcfg.n_units - 1, cfg.seed)
    w = eval_windows(dataset)
    with torch.no_grad():
        logits = model(w[:, :-1]).double()
        ev = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                               w[:, 1:].reshape(-1)).item()
    if cfg.arch == "gpt":
        return serial_losses(cfg, dataset), ev
    oc = cfg.optim()
    opt = torch_adamw(model, oc)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed)
    losses = []
    for step in range(cfg.steps):
        x, y = data.global_batch_at(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch_step(model, opt, oc, step)
        losses.append(loss.item())
    return losses, ev


def rounds(cases):
    """Cases in rounds: each round runs cases of one grid size side by side on
    consecutive blocks of ranks; [(size, [(case, first rank)])]."""
    out = []
    by_size: dict[int, list] = {}
    for case in cases:
        by_size.setdefault(int(np.prod(case[0])), []).append(case)
    for size, group in by_size.items():
        per_round = WORLD // size
        for i in range(0, len(group), per_round):
            out.append((size, [(c, j * size) for j, c in enumerate(group[i:i + per_round])]))
    return out


#: world ranks -> mcrdl group, shared by the grids of the launch: axis groups, and the
#: groups of a run's ranks (kept apart: the log maps each group to one axis or "world")
GROUPS: dict = {}
RUN_GROUPS: dict = {}


def place(size: int, slots):
    """Collective over the world: every slot's grid and the group of its ranks; returns
    (this rank's case, grid, group) or None when no slot holds this rank."""
    mine = None
    for case, first in slots:
        ranks = list(range(first, first + size))
        gx, gy, gz, gd = case[0]
        if tuple(ranks) not in RUN_GROUPS:
            RUN_GROUPS[tuple(ranks)] = mcrdl.new_group(ranks)
        group = RUN_GROUPS[tuple(ranks)]
        grid = ProcessGrid({"x": gx, "y": gy, "z": gz, "data": gd},
                           order=["x", "y", "z", "data"], world=group, group_cache=GROUPS)
        grid.make_groups()
        if grid.is_member:
            mine = (case, grid, group)
    return mine


def train(cfg: TrainConfig, grid, group, windows=None,
          **trainer_options) -> tuple[Trainer4D, list[float]]:
    """The trainer and its per-step losses; with `windows`, the fresh trainer's
    evaluate(windows) first (trainer.evaluated; its collectives are left out of this
    rank's communication log)."""
    trainer = Trainer4D(cfg, grid=grid, **trainer_options)
    trainer.evaluated = None if windows is None else trainer.evaluate(windows)
    mcrdl.reset_log()  # the byte counts are the training steps'
    return trainer, [trainer.train_step()[0] for _ in range(cfg.steps)]


def logged_counts(path: str, grid: ProcessGrid, group) -> dict:
    """{(op, axis): [calls, bytes]} of this rank's logged calls (mcrdl.export_trace),
    the group ids mapped to the grid's axes ("world": the run's group)."""
    mcrdl.export_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    axis_of = {group.id: "world"}
    for axis in ("x", "y", "z", "data"):
        g = grid.group(axis)
        if g is not None:
            axis_of[g.id] = axis
    counts: dict = {}
    for e in events:
        key = (e["name"], axis_of.get(e["args"]["group"], f"group {e['args']['group']}"))
        row = counts.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += e["args"]["bytes"]
    return counts


def model_counts(trainer: Trainer4D, steps: int) -> dict:
    """training.parallel4d.perf_model's (op, axis) -> [calls, bytes] for `steps` steps of
    `trainer`."""
    cfg = trainer.cfg
    step = TrainingStep(trainer.model_cfg, cfg.global_batch_size, trainer.batches.n_micro,
                        dtype_bytes=4, keep_weights=not cfg.regather_weights,
                        bucket_bytes=trainer.bucket_elements * 4)
    grid = Grid4D(cfg.G_x, cfg.G_y, cfg.G_z, cfg.G_data)
    return {k: [c * steps, b * steps] for k, (c, b) in call_counts(step, grid).items()}


def check_bytes(grid: tuple, got: dict, want: dict) -> str | None:
    """None when the log equals the model, else what differs; plus Megatron's and
    FSDP's shapes of the grids (G,1,1,1) and (1,1,G,1)."""
    if got != want:
        keys = sorted(set(got) | set(want))
        return "; ".join(f"{k}: logged {got.get(k)} model {want.get(k)}" for k in keys
                         if got.get(k) != want.get(k))
    gx, gy, gz, gd = grid
    ops = set(got)
    if gx > 1 and (gy, gz, gd) == (1, 1, 1):  # Megatron: only X all_reduces, logits gather
        if ops != {("all_reduce", "x"), ("all_gather", "x"), ("all_reduce", "world")}:
            return f"Megatron grid sent {sorted(ops)}"
    if gz > 1 and (gx, gy, gd) == (1, 1, 1):  # FSDP: no activation collectives
        if not ops <= {("all_gather", "z"), ("reduce_scatter", "z"), ("all_reduce", "z"),
                       ("all_reduce", "world")}:
            return f"FSDP grid sent {sorted(ops)}"
    return None


OVERLAP_GRID = (2, 1, 2, 2)  # OAR over X, ORS and OAG over Z, a data all_reduce
OVERLAP_STEPS = 6


# Synthetic seconds per (rank parity, mode) for the tuner: fixed numbers, so the decision
# never depends on how this machine's scheduler treated a measurement. Alone, an even
# rank would pick NT; summed over the 8 ranks TN wins (NT 4*1 + 4*3 = 16 > TN 14), so
# only a decision that agrees over the group's sum gives EXPECTED_MODES. NN is 8x slower
# than anything and must never be chosen. Forward swaps NT and TN.
SYNTHETIC = ({"NN": 8.0, "NT": 1.0, "TN": 2.0}, {"NN": 8.0, "NT": 3.0, "TN": 1.5})
EXPECTED_MODES = {"forward": "NT", "input_grad": "TN", "weight_grad": "TN"}


def synthetic_timer(phase, mode, fn):
    """Runs the kernel once (every mode is exercised) and returns SYNTHETIC's seconds."""
    fn()
    if phase == "forward":
        mode = {"NT": "TN", "TN": "NT"}.get(mode, mode)
    return SYNTHETIC[mcrdl.get_rank() % 2][mode]


def overlap_order(events) -> dict[str, bool]:
    """Whether the recorded issue/wait order of one step shows each overlap:
    OAG: the gather of the next weight is issued before this layer computes and waited
    after; OAR: each async input-gradient all_reduce is issued before its layer's weight
    gradient is computed and waited after; ORS: every Z reduce_scatter is waited after
    the last weight gradient is computed and before the first data all_reduce."""
    pos = {}
    for i, e in enumerate(events):
        pos.setdefault(e, i)
    issues = [e for e in events if e[0] == "issue"]
    gathers = [e[3] for e in issues if e[1:3] == ("all_gather", "z")]
    oag = len(gathers) > 1 and all(
        pos[("issue", "all_gather", "z", b)] < pos[("mark", "", "", f"compute {a}")]
        < pos[("wait", "all_gather", "z", b)] for a, b in zip(gathers, gathers[1:], strict=False))
    grads = [e[3] for e in issues if e[1] == "all_reduce" and e[3].endswith("input grad")]
    oar = bool(grads) and all(
        pos[("issue", "all_reduce", "x", g)] < pos[("mark", "", "", "compute dW "
                                                     + g[:-len(" input grad")])]
        < pos[("wait", "all_reduce", "x", g)] for g in grads)
    last_dw = max(i for i, e in enumerate(events) if e[3].startswith("compute dW"))
    first_data = min(i for i, e in enumerate(events) if e[:3] == ("issue", "all_reduce",
                                                                   "data"))
    rs_waits = [i for i, e in enumerate(events) if e[:3] == ("wait", "reduce_scatter", "z")]
    ors = bool(rs_waits) and all(last_dw < i < first_data for i in rs_waits)
    return {"OAG": oag, "OAR": oar, "ORS": ors}


def overlap_and_tuning(directory: str, ref: list[float]) -> None:
    """Collective over the 8 ranks, on OVERLAP_GRID: --overlap none, oar, oar+ors, all
    give bitwise identical losses; the recorded order of step 2 shows each overlap
    exactly when it is on; then overlap all with --tune-matmul (synthetic timings: NN
    8x slower, the group's sum deciding) trains 20 steps within 1e-5 of the serial run,
    every rank deciding the group-summed optimum."""
    from training.parallel4d.tuning import MatmulTuner
    rank = mcrdl.get_rank()
    mine = place(8, [((OVERLAP_GRID, "h4", {}), 0)])
    _, layout, group = mine
    losses, shown, exposed = {}, {}, {}
    for level in ("none", "oar", "oar+ors", "all"):
        cfg = config(directory, "h4", OVERLAP_STEPS, OVERLAP_GRID, overlap=level)
        trainer = Trainer4D(cfg, grid=layout, record=True)
        rec = trainer.comms.recorder
        got = [trainer.train_step()[0]]
        rec.clear()  # step 1 recorded the gather order (no prefetch yet)
        got.append(trainer.train_step()[0])
        shown[level] = overlap_order(list(rec.events))
        rec.enabled = False
        got += [trainer.train_step()[0] for _ in range(OVERLAP_STEPS - 2)]
        losses[level] = got
        exposed[level] = {k: round(v * 1e3 / OVERLAP_STEPS, 1)
                          for k, v in trainer.timers.snapshot().items() if k.startswith("exp")}
    everyone = mcrdl.all_gather_object((losses, shown))
    cfg = config(directory, "h4", 20, OVERLAP_GRID, overlap="all", tune_matmul=True)
    tuner = MatmulTuner(timer=synthetic_timer, group=group)
    _, tuned = train(cfg, layout, group, kernels=tuner)
    decisions = mcrdl.all_gather_object((tuner.decided, tuner.max_mode_diff))
    if rank != 0:
        return
    for r, (got, s) in enumerate(everyone):
        assert all(got[lv] == got["none"] for lv in got), f"rank {r}: losses differ {got}"
        want = {"none": (False, False, False), "oar": (False, True, False),
                "oar+ors": (False, True, True), "all": (True, True, True)}
        for level, flags in want.items():
            assert tuple(s[level][k] for k in ("OAG", "OAR", "ORS")) == flags, \
                f"rank {r} --overlap {level}: recorded order shows {s[level]}"
    print(f"4d overlap OK: {OVERLAP_GRID}, --overlap none/oar/oar+ors/all losses bitwise "
          f"identical over {OVERLAP_STEPS} steps ({losses['none'][-1]!r}); recorded order "
          "of step 2 shows OAR, ORS, OAG exactly when on, on all 8 ranks; rank 0 exposed ms "
          f"per step: {exposed}", flush=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(tuned, ref, strict=True))
    assert worst <= TOL, f"tuned run differs from serial by {worst:.2e}"
    first = decisions[0][0]
    assert all(d == first for d, _ in decisions), "ranks decided differently"
    assert first and all(mode == EXPECTED_MODES[key[0]] for key, mode in first.items()), \
        f"decisions {first} are not the group-summed synthetic optimum {EXPECTED_MODES}"
    diff = max(m for _, m in decisions)
    assert diff <= 1e-6, diff
    modes = sorted({f"{k[0]} {v}" for k, v in first.items()})
    print(f"4d tuning OK: overlap all + --tune-matmul, 20 steps, max rel diff {worst:.2e} vs "
          f"serial; {len(first)} shapes decided alike on all 8 ranks, each the group-summed "
          f"optimum of the synthetic timings (NN 8x slower never chosen); modes agree to "
          f"{diff:.1e}; chosen {modes}", flush=True)


CHECKPOINT_CASES = [((2, 1, 2, 1), "h4", {"offload_optimizer": True}),
                    ((1, 1, 2, 2), "h4", {"micro_batch_size": 1})]


def checkpoints(directory: str, dataset, results: dict) -> None:
    """Collective over the 8 ranks: two 4-rank grids side by side train 10 steps and
    save a checkpoint; a new trainer resumes from it and its steps 11-20 equal the
    uninterrupted parity run's exactly; the consolidated step-10 checkpoint equals the
    serial model after 10 steps within 1e-6 (ranks 0 and 4 check their grid's)."""
    from tests.training.reference import serial_run
    from training import checkpoint as checkpoint_tool
    rank = mcrdl.get_rank()
    common = mcrdl.broadcast_object(tempfile.mkdtemp(prefix="mcrdl-4d-ck-") if rank == 0
                                    else None)  # one directory for all ranks
    (grid, shape, options), layout, group = place(4, [(c, 4 * i) for i, c in
                                                      enumerate(CHECKPOINT_CASES)])
    ck = os.path.join(common, "-".join(map(str, grid)))
    cfg = config(directory, shape, 20, grid, checkpoint_dir=ck, **options)
    first = Trainer4D(cfg, grid=layout)
    for _ in range(10):
        first.train_step()
    saved = first.save_checkpoint()
    resumed = Trainer4D(cfg, grid=layout)
    start = resumed.load_checkpoint("latest")
    after = [resumed.train_step()[0] for _ in range(10)]
    live = first.serial_state_dict()  # the pieces in memory, gathered (collective)
    out = None
    if layout.rank == 0:
        full = results[(grid, shape, tuple(options.items()))][0]
        assert start == 10 and after == full[10:], (grid, after, full[10:])
        state, mcfg = checkpoint_tool.consolidate(saved)
        assert list(state) == list(live) and all(torch.equal(state[k], live[k]) for k in live)
        if options.get("offload_optimizer"):  # fp32: the masters are the model, bitwise
            masters, _ = checkpoint_tool.consolidate(saved, masters=True)
            assert list(masters) == list(state), list(masters)[:4]
            assert all(torch.equal(masters[k], state[k]) for k in state), grid
        _, model = serial_run(config(directory, shape, 20), dataset, steps=10)
        ref = model.state_dict()
        assert list(state) == list(ref), (list(state)[:4], list(ref)[:4])
        # vs the weights of 10 serial steps, within 1e-6, except the key part of
        # c_attn.bias: attention is invariant to it (it adds q.b_k to every score of a
        # query), so its exact gradient is 0 and AdamW's m / sqrt(v) turns the ~1e-10
        # rounding noise of each run into full-size steps: it is not determined
        c = mcfg["n_embd"]
        diff = 0.0
        for k in ref:
            d = (state[k] - ref[k]).abs()
            if k.endswith("attn.c_attn.bias"):
                d[c:2 * c] = 0
            diff = max(diff, d.max().item())
        assert diff <= 1e-6, (grid, diff)
        model.load_state_dict(state)
        x, y = first.batches.global_batch_at(10)
        with torch.no_grad():
            loss = lm_loss(model(x), y).item()
        assert abs(loss - after[0]) / loss <= 1e-6, (grid, loss, after[0])
        out = (grid, diff, abs(loss - after[0]) / loss)
        torch.save(state, os.path.join(ck, "serial.pt"))
    # the consolidated serial state_dict loads on another grid (--init-from)
    other = {(2, 1, 2, 1): ((4, 1, 1, 1), "h4", {}), (1, 1, 2, 2): ((1, 2, 1, 2), "h4", {})}
    (grid2, _, _), layout2, group2 = place(4, [(other[c[0]], 4 * i) for i, c in
                                               enumerate(CHECKPOINT_CASES)])
    mcrdl.all_gather_object(None)  # the serial.pt files are written
    moved = Trainer4D(config(directory, shape, 20, grid2,
                             init_from=os.path.join(ck, "serial.pt")), grid=layout2)
    # in bf16: the model rounds the file's weights, the fp32 masters keep them whole
    low = Trainer4D(config(directory, shape, 20, grid2, dtype="bf16",
                           init_from=os.path.join(ck, "serial.pt")), grid=layout2)
    whole = list(moved.model.parameters())
    position = {id(p): i for i, p in enumerate(low.model.parameters())}
    for p, off in zip(low.optimizer.params, low.optimizer.offsets, strict=True):
        want = whole[position[id(p)]]
        assert torch.equal(low.optimizer.master[off:off + p.numel()], want.reshape(-1)), grid2
        assert torch.equal(p, want.bfloat16()), grid2
    moved.step = low.step = 10
    loss11 = moved.train_step()[0]
    # ... and trains with them (OffloadedAdamW, bf16's optimizer) as the fp32 run does
    fp32_steps = [loss11] + [moved.train_step()[0] for _ in range(2)]
    bf16_steps = [low.train_step()[0] for _ in range(3)]
    rel16 = max(abs(a - b) / b for a, b in zip(bf16_steps, fp32_steps, strict=True))
    assert rel16 <= BF16_TOL, (grid2, bf16_steps, fp32_steps)
    del low
    if out is not None:
        rel11 = abs(loss11 - after[0]) / after[0]
        assert rel11 <= 1e-6, (grid, grid2, loss11, after[0])
        out = (*out, grid2, rel11, rel16)
    # the same X, Y, Z degrees on another G_data (README: "any G_data"): (1, 1, 2, 2)'s
    # step-10 checkpoint resumed by (1, 1, 2, 1), which takes each step's global batch in
    # twice the micro-batches: steps 11-20 equal the uninterrupted run to rounding
    halved = ((1, 1, 2, 1), "h4", {"micro_batch_size": 1})
    mine = place(2, [(halved, 0)])
    if mine is not None:
        (grid3, shape3, options3), layout3, _ = mine
        wide = CHECKPOINT_CASES[1]
        cfg3 = config(directory, shape3, 20, grid3, **options3,
                      checkpoint_dir=os.path.join(common, "-".join(map(str, wide[0]))))
        narrow = Trainer4D(cfg3, grid=layout3)
        start3 = narrow.load_checkpoint("latest")
        after3 = [narrow.train_step()[0] for _ in range(10)]
        if layout3.rank == 0:
            full = results[(wide[0], wide[1], tuple(wide[2].items()))][0]
            rel3 = max(abs(a - b) / b for a, b in zip(after3, full[10:], strict=True))
            assert start3 == 10 and rel3 <= 1e-6, (start3, after3, full[10:])
            print(f"4d resume on another G_data OK: {wide[0]}'s step-10 checkpoint on "
                  f"{grid3}: steps 11-20 within {rel3:.1e} of the uninterrupted run",
                  flush=True)
        del narrow
    gathered = [g for g in mcrdl.all_gather_object(out) if g is not None]
    if rank == 0:
        import shutil
        shutil.rmtree(common, ignore_errors=True)
        print("4d checkpoints OK: " + "; ".join(
            f"{g}: resumed steps 11-20 equal the uninterrupted run exactly; consolidated "
            f"step 10 = the live pieces reassembled bitwise, serial GPT loads it and gives "
            f"step 11's loss to {d:.1e} rel; vs 10 serial steps: max abs diff {r:.1e} "
            f"(key bias excluded); loaded on {g2} (--init-from) step 11's loss to {d2:.1e}, "
            f"in bf16 steps 11-13 to {d16:.1e}"
            for g, r, d, g2, d2, d16 in gathered), flush=True)


def main():
    mcrdl.init(["mpi"])
    mcrdl.configure(logging=True)
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    assert n == WORLD, f"run with mpiexec -n {WORLD}"
    torch.set_num_threads(1)
    steps = int(os.environ.get("PARITY_STEPS", 20))
    directory = scratch_dir(f"mcrdl-4d-{rank}-")
    dataset = token_data(directory)
    cases = CASES
    if os.environ.get("GRIDS_4D"):
        wanted = {tuple(int(v) for v in g.split(",")) for g in os.environ["GRIDS_4D"].split(";")}
        cases = [c for c in cases if c[0] in wanted]
    if os.environ.get("ARCH_4D"):  # "gpt" or "llama": that family's cases only
        cases = [c for c in cases if c[1][0] == {"gpt": "h", "llama": "l"}[os.environ["ARCH_4D"]]]
    results = {}  # (grid, shape, options) -> losses, on rank 0
    evals = {}  # (grid, shape, options) -> every rank's evaluate()
    refs = {}  # shape -> (serial losses, serial evaluation)
    todo_refs = sorted({c[1] for c in cases})
    t0 = time.perf_counter()
    for size, slots in rounds(cases):
        mine = place(size, slots)
        mcrdl.reset_log()
        out = None
        if mine is not None:
            (grid, shape, options), layout, group = mine
            trainer, losses = train(config(directory, shape, steps, grid, **options), layout,
                                    group, eval_windows(dataset) if grid in EVAL_GRIDS
                                    and shape.startswith("l") else None)
            problem = check_bytes(grid, logged_counts(os.path.join(directory, "trace.json"),
                                                      layout, group),
                                  model_counts(trainer, steps))
            problems = mcrdl.all_gather_object(problem, group=group)
            evaluated = mcrdl.all_gather_object(trainer.evaluated, group=group)
            if layout.rank == 0:
                out = ("run", (grid, shape, tuple(options.items())), (losses, problems),
                       evaluated)
        elif todo_refs:  # a rank no grid of this round uses: a serial reference
            idle = sorted(set(range(WORLD)) - {f + i for _, f in slots for i in range(size)})
            k = idle.index(rank)
            if k < len(todo_refs):
                shape = todo_refs[k]
                out = ("ref", shape, reference(config(directory, shape, steps), dataset))
        gathered = mcrdl.all_gather_object(out)  # also the end of the round
        for item in filter(None, gathered):
            if item[0] == "run":
                results[item[1]] = item[2]
                if item[3][0] is not None:
                    evals[item[1]] = item[3]
            else:
                refs[item[1]] = item[2]
                todo_refs.remove(item[1])
    for shape in todo_refs:  # no round left a rank idle
        refs[shape] = reference(config(directory, shape, steps), dataset)
    refs = {shape: losses for shape, (losses, _) in refs.items()} | \
        {("eval", shape): ev for shape, (_, ev) in refs.items()}
    if os.environ.get("CHECKPOINT_4D", "1") == "1" and all(
            (c[0], c[1], tuple(c[2].items())) in results for c in CHECKPOINT_CASES):
        checkpoints(directory, dataset, results)
    if os.environ.get("OVERLAP_4D", "1") == "1":
        if "h4" not in refs:
            refs["h4"] = serial_losses(config(directory, "h4", 20), dataset)
        overlap_and_tuning(directory, refs["h4"][:20])
    if rank == 0:
        worst_all = 0.0
        for (grid, _, _), (_, problems) in results.items():
            bad = [(r, p) for r, p in enumerate(problems) if p is not None]
            if bad:
                raise AssertionError(f"4d bytes FAILED on {grid}, rank {bad[0][0]}: {bad[0][1]}")
        print(f"4d bytes OK: {len(results)} grids x {steps} steps, every rank's calls and bytes "
              "per (op, axis) equal training.parallel4d.perf_model's; (G,1,1,1) sends only "
              "Megatron's collectives, (1,1,G,1) no activation collectives", flush=True)
        for (grid, shape, options), (got, _) in results.items():
            ref = refs[shape]
            rel = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
            worst = max(rel)
            worst_all = max(worst_all, worst)
            print(f"4d parity {grid} {shape} {dict(options) or ''}: {steps} steps, loss "
                  f"{got[0]:.5f} -> {got[-1]:.5f}, max rel diff {worst:.2e}", flush=True)
            if worst > TOL:
                for i, (a, b) in enumerate(zip(got, ref, strict=True)):
                    print(f"  step {i + 1}: parallel {a:.8f} serial {b:.8f}")
                raise AssertionError(f"4d parity FAILED on {grid}: max rel diff {worst:.2e}")
            assert got[-1] < got[0] - 0.1, (grid, got[0], got[-1])  # it trains
        assert len(results) == len(cases), (len(results), len(cases))
        for (grid, shape, _), got in evals.items():
            want = refs[("eval", shape)]
            rel = max(abs(g - want) / want for g in got)
            print(f"4d evaluate {grid} {shape}: {EVAL_WINDOWS} windows, {got[0]:.6f} on all "
                  f"{len(got)} ranks (identical: {len(set(got)) == 1}), serial {want:.6f}, "
                  f"rel diff {rel:.1e}", flush=True)
            assert len(set(got)) == 1 and rel <= TOL, (grid, shape, got, want)
        want_evals = {g for g in EVAL_GRIDS if any(c[0] == g and c[1].startswith("l")
                                                      for c in cases)}
        assert {g for g, _, _ in evals} == want_evals, (sorted(evals), want_evals)
        print(f"4d parity OK: {len(results)} grids x {steps} steps, max rel diff "
              f"{worst_all:.2e} ({time.perf_counter() - t0:.1f} s)", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    failfast.run(main)
