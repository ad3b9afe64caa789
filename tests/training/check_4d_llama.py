"""The 4D engine importing a Hugging Face Llama (``--init-from hf:DIR``), under
``mpiexec -n 4`` (one launch; rank 0 prints one line per check and "4d llama OK"):

- Memory of the import: a random LlamaForCausalLM made locally with transformers (made
  in a child process, so that its memory is not this launch's), whose weights are 4x
  one rank's share on each grid of GRIDS. Each rank's peak resident memory grows, over
  ``read_init`` + ``GPT4D(source=...)``, by at most RSS_LIMIT x its own share (the
  bytes of its pieces), never by the whole model: each rank reads only the rows its
  pieces touch (tensor_parallel.layers.read_piece through safetensors slices). The
  peak is the kernel's high-water mark (VmHWM), reset before the import
  (/proc/self/clear_refs), less the resident memory before it.
- Parity: the model imported on each grid gives the logits of the serial Llama loaded
  with the same directory (training/models/hf.py), and ``Trainer4D.evaluate`` of a run
  ``--init-from hf:DIR`` equals the serial model's mean loss on the same windows,
  within 1e-5 relative (fp32).
- Layout in, layout out: imported on (2,1,1,2), 3 steps, checkpoint; consolidated it is
  the live pieces bitwise; resumed it continues exactly; exported (export-hf) and
  imported on (1,2,2,1) it evaluates as the first run did (checkpoint_round_trip).

``python tests/training/check_4d_llama.py --make DIR`` writes the model directory.
"""

import ctypes
import gc
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.training import _failfast as failfast  # noqa: E402

#: the model: 4 blocks of width 512, 8 query / 4 key-value heads, vocabulary 4096
#: (about 13.6 M parameters, 54 MB in float32), untied
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
             max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
#: 4-rank grids. On (1,1,4,1), (1,2,2,1) and (1,4,1,1) every weight is split 4 ways, the
#: full model 4x a rank's share; X does not split the embedding (nor the RMSNorm
#: weights), so on (4,1,1,1) and (2,2,1,1) the share is larger (the full model 2.7x
#: and 3.2x it)
GRIDS = [(1, 1, 4, 1), (1, 2, 2, 1), (1, 4, 1, 1), (4, 1, 1, 1), (2, 2, 1, 1)]
FOUR_WAYS = {(1, 1, 4, 1), (1, 2, 2, 1), (1, 4, 1, 1)}
#: peak growth over the share: the share itself (1.0) and what is in flight while a
#: piece is read: at most READ_ROWS_BYTES (256 KiB) of whole rows where a piece takes
#: part of the columns, and the heap's free holes they leave (measured: 1.00-1.01 on
#: (1,1,4,1), 1.01-1.08 on (4,1,1,1), 1.04-1.20 where Y splits the columns)
RSS_LIMIT = 1.5
#: which growth RSS_LIMIT bounds: "total", the peak resident memory (VmHWM); its
#: private part ("anon") and the file pages the reader maps are shown beside it
LIMITED = "total"
TOL = 1e-5


def make(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).float()
    with torch.no_grad():  # RMSNorm weights away from one, so that a wrong slice shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(directory, safe_serialization=True)


def status_kib() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


class AnonPeak:
    """The peak of private (anonymous) resident memory, sampled every 0.2 ms by a
    thread (the kernel keeps no high-water mark of it alone)."""

    def __enter__(self):
        import threading
        self.peak, self._stop = status_kib()["RssAnon"], False
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        import time
        while not self._stop:
            self.peak = max(self.peak, status_kib()["RssAnon"])
            time.sleep(2e-4)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.peak = max(self.peak, status_kib()["RssAnon"])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark of resident memory back to the current


def checkpoint_round_trip(directory: str, data: str, cfg, windows: torch.Tensor) -> None:
    """Collective over the 4 ranks: import on (2,1,1,2), 3 steps, checkpoint; the
    consolidated checkpoint is the live pieces reassembled (bitwise, the manifest naming
    the llama family); resumed on the same grid, step 4 equals the uninterrupted run's;
    exported (python -m training.checkpoint export-hf) and imported on (1,2,2,1),
    evaluate() equals the first run's after 3 steps within 1e-5."""
    import dataclasses

    import mcrdl
    from training import checkpoint as checkpoint_tool
    from training.models.families import config_from_dict
    from training.parallel4d.trainer import Trainer4D
    from training.train_gpt import TrainConfig

    rank = mcrdl.get_rank()
    ck = os.path.join(directory, "ck")

    def run(grid, **options):
        gx, gy, gz, gd = grid
        return TrainConfig(**{**dict(
            init_from=f"hf:{directory}", data=data, vocab_size=cfg.vocab_size, block_size=16,
            global_batch_size=4, micro_batch_size=1, steps=4, lr=1e-3, warmup_steps=1,
            G_x=gx, G_y=gy, G_z=gz, G_data=gd, engine="4d", plot=False, progress=False,
            quiet=True, out_dir=os.path.join(directory, "out"), checkpoint_dir=ck),
            **options})

    first = Trainer4D(run((2, 1, 1, 2)))
    losses = [first.train_step()[0] for _ in range(3)]
    saved = first.save_checkpoint()
    trained = first.evaluate(windows)
    live = first.serial_state_dict()
    step4 = first.train_step()[0]
    # the shape from the same directory's config.json; --resume skips its weights
    resumed = Trainer4D(run((2, 1, 1, 2), resume="latest"))
    start = resumed.load_checkpoint("latest")
    again = resumed.train_step()[0]
    exported = os.path.join(directory, "exported")
    if rank == 0:
        state, model = checkpoint_tool.consolidate(saved)
        assert config_from_dict(model) == dataclasses.replace(cfg, block_size=16), model
        assert list(state) == list(live) and all(torch.equal(state[k], live[k]) for k in live)
        checkpoint_tool.export_hf(saved, exported)
        assert start == 3 and again == step4, (start, again, step4)
    mcrdl.barrier("auto")
    moved = Trainer4D(run((1, 2, 2, 1), init_from=f"hf:{exported}"))
    got = moved.evaluate(windows)
    rel = abs(got - trained) / trained
    if rank == 0:
        assert rel <= TOL, (got, trained)
        print(f"4d llama checkpoint OK: imported on (2, 1, 1, 2), losses "
              f"{', '.join(f'{v:.5f}' for v in losses)}; the consolidated step-3 checkpoint "
              f"(arch llama) = the live pieces bitwise; resumed, step 4 equal ({again:.6f}); "
              f"exported to hf and imported on (1, 2, 2, 1), evaluate() {got:.6f} vs "
              f"{trained:.6f} (rel {rel:.1e})", flush=True)


def main() -> None:
    import mcrdl
    from training.core.topology import ProcessGrid
    from training.models.families import read_hf_config
    from training.models.hf import load_hf
    from training.models.init_source import read_init
    from training.models.llama import Llama
    from training.parallel4d.model import GPT4D
    from training.parallel4d.trainer import Trainer4D, build_comms
    from training.tensor_parallel.comm import Overlap
    from training.train_gpt import TrainConfig

    mcrdl.init(["mpi"])
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    assert world == 4, "run with mpiexec -n 4"
    torch.set_num_threads(1)
    directory = mcrdl.broadcast_object(tempfile.mkdtemp(prefix="mcrdl-4d-llama-")
                                       if rank == 0 else None)
    if rank == 0:
        subprocess.run([sys.executable, __file__, "--make", directory], check=True)
    mcrdl.barrier("auto")
    cfg = read_hf_config(directory)
    full_bytes = cfg.n_params() * 4
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    serial = None
    if rank == 0:
        serial = load_hf(directory)
    rows = []
    # the first import pays one-time costs (imports, the meta template's first build):
    # one on the whole world's first grid, not measured
    for grid_degrees in [GRIDS[0], *GRIDS]:
        gx, gy, gz, gd = grid_degrees
        grid = ProcessGrid({"x": gx, "y": gy, "z": gz, "data": gd},
                           order=["x", "y", "z", "data"])
        grid.make_groups()
        comms = build_comms(grid, {}, Overlap.from_level("none"))
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the previous grid's model, freed
        mcrdl.barrier("auto")
        before = status_kib()
        reset_peak()
        with AnonPeak() as anon:
            source = read_init(f"hf:{directory}", lambda: Llama(cfg), None)
            model = GPT4D(cfg, comms, source=source)
            mapped = status_kib()["RssFile"] - before["RssFile"]
            source.close()
        share = sum(p.numel() * p.element_size() for p in model.parameters())
        growth = {"total": (status_kib()["VmHWM"] - before["VmRSS"]) * 1024,
                  "anon": (anon.peak - before["RssAnon"]) * 1024, "mapped": mapped * 1024}
        with torch.no_grad():
            logits = model(x)
        rows.append((grid_degrees, growth, share, logits))
        del model, source
        if len(rows) == 1 and grid_degrees == GRIDS[0] and not hasattr(main, "warm"):
            main.warm = rows.pop()
        mcrdl.barrier("auto")
    gathered = mcrdl.all_gather_object([(g, gr, sh) for g, gr, sh, _ in rows])
    if rank == 0:
        with torch.no_grad():
            want = serial(x)
        for (grid_degrees, _, share, logits) in rows:
            if grid_degrees in FOUR_WAYS:
                assert abs(full_bytes / share - 4) < 0.01, (grid_degrees, full_bytes, share)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        worst = 0.0
        for i, grid_degrees in enumerate(GRIDS):
            per_rank = [r[i] for r in gathered]
            share = per_rank[0][2]

            def show(kind, per_rank=per_rank, share=share):
                return ", ".join(f"{gr[kind] / share:.2f}" for _, gr, _ in per_rank)
            worst = max(worst, *(gr[LIMITED] / sh for _, gr, sh in per_rank))
            print(f"4d llama import {grid_degrees}: full model {full_bytes / 2**20:.1f} MiB = "
                  f"{full_bytes / share:.1f} x the share of {share / 2**20:.1f} MiB per rank; "
                  f"per rank, x the share: private (anonymous) memory peak growth {show('anon')}"
                  f"; file pages mapped by the reader {show('mapped')}; peak RSS (VmHWM) "
                  f"growth {show('total')}; logits = serial", flush=True)
        assert worst <= RSS_LIMIT, \
            f"peak {LIMITED} memory growth {worst:.2f} x the share > {RSS_LIMIT}"
    # evaluate of a run --init-from hf:DIR against the serial model's loss
    data = os.path.join(directory, "data")
    if rank == 0:
        os.makedirs(data, exist_ok=True)
        tokens = torch.randint(0, cfg.vocab_size, (4096,), generator=g).numpy()
        tokens.astype(np.uint16).tofile(os.path.join(data, "train.bin"))
    mcrdl.barrier("auto")
    windows = torch.from_numpy(np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16)
                               .astype(np.int64)[:5 * 17]).view(5, 17)
    want = None
    if rank == 0:
        with torch.no_grad():
            logits = serial(windows[:, :-1]).double()
            want = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.size(-1)), windows[:, 1:].reshape(-1)).item()
    want = mcrdl.broadcast_object(want)
    for grid_degrees in ((2, 1, 1, 2), (1, 2, 2, 1)):
        gx, gy, gz, gd = grid_degrees
        run = TrainConfig(init_from=f"hf:{directory}", data=data, vocab_size=cfg.vocab_size,
                          block_size=16, global_batch_size=4, micro_batch_size=1, steps=1,
                          G_x=gx, G_y=gy, G_z=gz, G_data=gd, engine="4d", plot=False,
                          progress=False, quiet=True,
                          out_dir=os.path.join(directory, "out"))
        trainer = Trainer4D(run)
        got = trainer.evaluate(windows)
        everyone = mcrdl.all_gather_object(got)
        rel = abs(got - want) / want
        if rank == 0:
            assert len(set(everyone)) == 1 and rel <= TOL, (grid_degrees, everyone, want)
            print(f"4d llama evaluate {grid_degrees} --init-from hf: 5 windows of 16, "
                  f"{got:.6f} on all ranks, serial {want:.6f}, rel diff {rel:.1e}",
                  flush=True)
        del trainer
    checkpoint_round_trip(directory, data, cfg, windows)
    mcrdl.barrier("auto")
    if rank == 0:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)
        print("4d llama OK", flush=True)
    mcrdl.finalize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(sys.argv[2])
        sys.exit(0)
    failfast.run(main)
