"""TED with ``--arch mixtral`` (training/models/mixtral.py) against the serial Mixtral,
dropless routing across layouts, and a Hugging Face MixtralForCausalLM imported into a
layout. Run under ``mpiexec -n 4`` (one launch for every check):

- parity: each layout of RUNS trains STEPS fp32 steps; every step's LM and aux loss
  equals the serial Mixtral's (one process, the whole batch per forward, torch's AdamW)
  to 1e-5 relative. "mixtral parity OK".
- Goldfish (k 2, h 4) on (2, 2, 2): the loss over the kept targets of the global batch
  equals the serial one's to 1e-5.
- dropless (capacity_factor 0): the dropless runs of RUNS drop nothing and their losses
  agree across layouts to 1e-5 (one serial reference for all). "mixtral dropless OK".
- hf import: rank 0 makes a tiny random MixtralForCausalLM (4 experts, top-2) and saves
  it; ``--init-from hf:DIR`` on (G_tensor 2, G_expert 2, G_data 2) reads on each rank
  only the experts it holds, and ``trainer.evaluate(windows)`` equals HF's own loss on
  the same windows to 1e-5 (fp32), windows padded with ignored targets included.
  "mixtral hf OK".
- memory (not run by default: ``MIXTRAL_CHECKS=memory``): a MixtralForCausalLM of ~100
  MiB (8 experts, 4 layers of width 256) into (2, 2, 2); each rank's RSS growth while
  it reads the model and builds its share, against its share's bytes.
  "mixtral import memory: ..." per rank.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from tests.training._scratch import scratch_dir  # noqa: E402
from tests.training.reference import torch_adamw, torch_step  # noqa: E402
from training.core.data import Batches, eval_windows, load_dataset  # noqa: E402
from training.models.mixtral import Mixtral  # noqa: E402
from training.models.moe import moe_loss  # noqa: E402
from training.ted.trainer import MoETrainer  # noqa: E402
from training.train_moe import MoETrainConfig, run  # noqa: E402

TOL = 1e-5
STEPS = int(os.environ.get("PARITY_STEPS", 8))
# (G_tensor, G_expert, G_data_nonexp, capacity_factor, options); 4 experts, top-2
RUNS = [
    (2, 2, 2, 1.0, {"dtd": True}),
    (2, 2, 2, 0, {"dtd": True, "activation_checkpointing": True, "cac": True}),
    (1, 4, 4, 0, {"optimizer_tile": 500}),
    (2, 1, 2, 0, {}),
    (1, 2, 4, 1.0, {}),
    # Goldfish: the loss is the mean over the kept targets of the whole global batch
    (2, 2, 2, 0, {"goldfish_k": 2, "goldfish_h": 4}),
]
GOLDFISH = ("goldfish_k", "goldfish_h")


def tiny(**kw) -> MoETrainConfig:
    base = dict(arch="mixtral", model="moe-tiny", steps=STEPS, experts=4, top_k=2,
                router_group_tokens=32, moe_every=1, micro_batch_size=2,
                global_batch_size=8, seed=7, lr=3e-3, warmup_steps=3, plot=False,
                progress=False, quiet=True, comm_log=False,
                out_dir=scratch_dir("mcrdl-mixtral-check-"))
    return MoETrainConfig(**{**base, **kw})


def serial_losses(cfg: MoETrainConfig, dataset) -> list[tuple[float, float]]:
    """(LM loss, aux loss) per step of the serial Mixtral: the whole global batch in one
    forward, torch's AdamW and clipping (tests/training/reference.py's serial MoE)."""
    cfg.validate()
    mcfg, moe = cfg.model_config(dataset.vocab_size), cfg.moe_config()
    oc = cfg.optim()
    model = Mixtral(mcfg, moe, seed=cfg.seed)
    opt = torch_adamw(model, oc)
    data = Batches(dataset, mcfg.block_size, cfg.global_batch_size, cfg.global_batch_size,
                   seed=cfg.seed, goldfish=cfg.goldfish())
    out = []
    for step in range(cfg.steps):
        x, y = data.global_batch_at(step)
        logits, stats = model(x)
        loss, lm = moe_loss(logits, y, stats, moe)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch_step(model, opt, oc, step)
        out.append((lm.item(), stats.aux_loss.item()))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def parity(data, rank, n):
    def key(cap, opts):
        return (cap, *(opts.get(k) for k in GOLDFISH))

    refs = {}
    refs_needed = sorted({key(cap, opts) for *_, cap, opts in RUNS}, key=str)
    mine = {k: serial_losses(tiny(capacity_factor=k[0], **{
        o: v for o, v in zip(GOLDFISH, k[1:], strict=True) if v is not None}), data)
        for i, k in enumerate(refs_needed) if i % n == rank}
    for part in mcrdl.all_gather_object(mine):
        refs.update(part)
    worst, dropless = 0.0, []
    for gt, ge, gd, cap, opts in RUNS:
        ref = refs[key(cap, opts)]
        t0 = time.perf_counter()
        res = run(tiny(capacity_factor=cap, G_tensor=gt, G_expert=ge, G_data=gd,
                       debug_checks=True, **opts), dataset=data)
        got = list(zip([loss for _, loss in res.losses], res.aux, strict=True))
        diff = max(max(rel(a, b), rel(c, d))
                   for (a, c), (b, d) in zip(got, ref, strict=True))
        worst = max(worst, diff)
        if rank == 0:
            print(f"mixtral parity G_tensor={gt} G_expert={ge} G_data={gd} capacity_factor="
                  f"{cap} {opts}: loss {got[0][0]:.5f} -> {got[-1][0]:.5f}, aux "
                  f"{got[-1][1]:.4f}, dropped {max(res.dropped):.3f}, max rel diff "
                  f"{diff:.2e} ({time.perf_counter() - t0:.1f} s)", flush=True)
        assert diff <= TOL, (got, ref)
        assert got[-1][0] < got[0][0] - 0.1, got  # it trains
        if "goldfish_k" in opts:  # a different loss: not one of the dropless twins
            assert got != refs[key(cap, {})], got
        elif cap == 0:
            assert max(res.dropped) == 0.0, res.dropped
            load = res.trainer.last["load"]
            assert all(d == 0 for layer in load for d in layer["dropped"]), load
            dropless.append([loss for _, loss in res.losses])
        else:
            assert max(res.dropped) > 0.0, res.dropped  # the capacity does drop
    across = max(rel(a, b) for losses in dropless[1:]
                 for a, b in zip(losses, dropless[0], strict=True))
    assert across <= TOL, dropless
    if rank == 0:
        print(f"mixtral parity OK: world {n}, {len(RUNS)} runs x {STEPS} steps, max rel diff "
              f"{worst:.2e}", flush=True)
        print(f"mixtral dropless OK: {len(dropless)} layouts, nothing dropped, losses agree "
              f"to {across:.2e}", flush=True)


def hf_import(data, rank):
    """A tiny MixtralForCausalLM into (2, 2, 2): each rank reads its experts only, and
    evaluate() gives HF's loss."""
    root = mcrdl.broadcast_object(scratch_dir("mcrdl-mixtral-hf-"))
    hf_dir = os.path.join(root, "hf")
    # 7 windows: the last microbatches padded with ignored windows
    windows = eval_windows(data.splits["train"], 7, 16)
    if rank == 0:
        from transformers import MixtralConfig as HFMixtralConfig
        from transformers import MixtralForCausalLM

        torch.manual_seed(0)
        hf = MixtralForCausalLM(HFMixtralConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64)).eval()
        hf.save_pretrained(hf_dir)
        with torch.no_grad():
            logits = hf(windows[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).double(),
                                                 windows[:, 1:].reshape(-1)).item()
    mcrdl.barrier("mpi")
    read = {}  # name -> index, as this rank asked the source for it
    import training.ted.trainer as ted_trainer
    original = ted_trainer.read_init

    def recording(*args, **kwargs):  # the tensors this rank takes from the source
        source = original(*args, **kwargs)
        parts = source.parts

        def taken(wanted):
            read.update(wanted)
            return parts(wanted)
        source.parts = taken
        return source

    ted_trainer.read_init = recording
    try:
        trainer = MoETrainer(tiny(init_from=f"hf:{hf_dir}", G_tensor=2, G_expert=2, G_data=2,
                                  block_size=16, capacity_factor=0, experts=None,
                                  top_k=None, moe_every=None, dtd=True), dataset=data)
    finally:
        ted_trainer.read_init = original
    mine = set(trainer.groups.local_experts(4))
    experts = {int(name.split(".experts.")[1].split(".")[0]) for name in read
               if ".experts." in name}
    assert experts == mine, (rank, experts, mine)
    # tensor-parallel weights: only this tensor rank's half of the rows (N-layers:
    # q/k/v, gate, up) or of the columns (T-layers: o, down)
    t, split_dim = trainer.groups.tensor_rank, {"q_proj": 0, "k_proj": 0, "v_proj": 0,
                                                "gate_proj": 0, "up_proj": 0,
                                                "o_proj": 1, "down_proj": 1}
    for name, index in read.items():
        kind = name.split(".")[-2]
        if kind not in split_dim:
            assert index is None, (name, index)  # replicated: whole
            continue
        cut = index[split_dim[kind]]
        width = cut.stop - cut.start
        assert cut.start == t * width and width in (8, 16, 24), (name, index)
    halves = sum(1 for index in read.values() if index is not None)
    # the cost model's exact count of a rank's parameters, Llama-shaped (no biases)
    from training.ted.cost_model import rank_params
    from training.ted.model import count_parameters
    counted = count_parameters(trainer.model)
    assert counted == rank_params(trainer.model_cfg, trainer.moe_cfg, trainer.layout), counted
    got = trainer.evaluate(windows)
    if rank == 0:
        assert rel(got, want) <= TOL, (got, want)
        print(f"mixtral hf OK: MixtralForCausalLM on G_tensor=2 G_expert=2 G_data=2, each "
              f"rank reading its 2 of 4 experts and its tensor-parallel halves ({halves} "
              f"slices); evaluate {got:.7f}, HF {want:.7f} "
              f"(rel {rel(got, want):.1e})", flush=True)


def import_memory(rank):
    """RSS growth of ``read_init`` + TEDGPT from an HF directory, per rank, against the
    bytes of the parameters the rank holds (its share: 1/4 of the experts, 1/2 of the
    attention, the replicated rest). The baseline is taken after torch has loaded its
    meta-device kernels (a fixed ~75 MiB on first use, whatever the model)."""
    import resource

    from training.models.hf import HFCheckpoint
    from training.models.init_source import read_init
    from training.ted.model import TEDGPT, TEDGroups, TEDLayout

    root = mcrdl.broadcast_object(scratch_dir("mcrdl-mixtral-mem-"))
    hf_dir = os.path.join(root, "hf")
    if rank == 0:
        from transformers import MixtralConfig as HFMixtralConfig
        from transformers import MixtralForCausalLM

        torch.manual_seed(0)
        MixtralForCausalLM(HFMixtralConfig(
            vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
            num_experts_per_tok=2, max_position_embeddings=64)).save_pretrained(hf_dir)
    mcrdl.barrier("mpi")
    with HFCheckpoint(hf_dir) as ckpt:
        cfg, moe = ckpt.config, ckpt.moe
    groups = TEDGroups(TEDLayout(2, 2, 2))
    with torch.device("meta"):
        Mixtral(cfg, moe)

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    source = read_init(f"hf:{hf_dir}", lambda: Mixtral(cfg, moe))
    model = TEDGPT(cfg, moe, groups, state_dict=source)
    source.close()
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss())
    share = sum(p.numel() * p.element_size() for p in model.parameters())
    # the peak since the process began (an overstatement where an earlier peak was
    # higher); rank 0 built the HF model before, so its current RSS instead
    grown = peak - before if rank else rss() - before
    size = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
    for r, (g, s) in enumerate(mcrdl.all_gather_object((grown, share))):
        if rank == 0:
            print(f"mixtral import memory: rank {r}: model file {size / 2**20:.1f} MiB, "
                  f"share {s / 2**20:.1f} MiB, RSS grew {g / 2**20:.1f} MiB "
                  f"({g / s:.2f} x the share){' (current, not peak)' if r == 0 else ''}",
                  flush=True)


def main():
    mcrdl.init(["mpi"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    data = load_dataset(os.environ.get("MOE_DATA", "stdlib"), 256)
    checks = os.environ.get("MIXTRAL_CHECKS", "parity,hf").split(",")
    if "parity" in checks:
        parity(data, rank, n)
    if "hf" in checks:
        hf_import(data, rank)
    if "memory" in checks:
        import_memory(rank)
    mcrdl.finalize()


if __name__ == "__main__":
    main()
