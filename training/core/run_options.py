"""The option sections every training command shares: the model, the data, the
optimizer and the run (steps, precision, backends, checkpoints, output). An engine
composes its config class from these and its own sections (training/core/options.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .backends import Backends
from .checkpoint import TRUST_HELP, latest_checkpoint
from .data import META, ByteCorpus, read_meta, token_dtype
from .dtypes import NAMES, dtype_name
from .goldfish import Goldfish
from .optim import OptimConfig
from .options import Options, PathOptionError, check_directory, check_file, flag, option


@dataclass
class ModelOptions(Options):
    section = "model"
    arch: str = option("gpt", "model family: gpt (GPT-2 style) or llama (RMSNorm, rotary, "
                       "SwiGLU, grouped-query attention)", choices=("gpt", "llama"))
    model: str = option("tiny", "model size (the --arch family's CONFIGS: "
                        "training/models/gpt.py, llama.py)")
    n_layer: int | None = option(None, "transformer blocks (overrides --model)", minimum=1)
    n_head: int | None = option(None, "attention heads (overrides --model)", minimum=1)
    n_embd: int | None = option(None, "embedding width (overrides --model)", minimum=1)
    block_size: int | None = option(None, "context length in tokens (overrides --model)",
                                    minimum=1)
    n_kv_head: int | None = option(None, "key/value heads of grouped-query attention "
                                   "(--arch llama; overrides --model)", minimum=1)
    activation_checkpointing: bool = option(False, "store activations every ~sqrt(N) blocks")

    def model_error(self, error: ValueError) -> str:
        """`error` of resolving the model's shape, as a refusal naming the model options."""
        given = " ".join(f"{flag(n)} {getattr(self, n)}" for n in
                         ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size")
                         if getattr(self, n))
        text = str(error).removeprefix("GPTConfig: ").removeprefix("LlamaConfig: ")
        arch = f"--arch {self.arch} " if self.arch != "gpt" else ""
        return f"{arch}--model {self.model}{' ' + given if given else ''}: {text}"


# --init-from's prefix of a Hugging Face model directory
HF_PREFIX = "hf:"

# load_dataset's (training/core/data.py): the names of the byte corpus, and the
# vocabulary of a token directory without --vocab-size
_TOKEN_VOCAB = 50304


def _is_stdlib(data: str | None) -> bool:
    return data in (None, "", "stdlib")


@dataclass
class DataOptions(Options):
    section = "data"
    data: str = option("stdlib", "'stdlib' (bytes of Python's sources) or a directory of "
                       "train.bin/val.bin token ids ('python -m training.data prepare' "
                       "writes one; nanoGPT's uint16 files too)")
    vocab_size: int | None = option(None, "vocabulary of --data DIR's tokens (default: its "
                                    "meta.json's, else 50304)", minimum=1)
    micro_batch_size: int = option(2, "sequences per microbatch", minimum=1)
    global_batch_size: int = option(8, "sequences per step, over all data-parallel ranks",
                                    minimum=1)
    goldfish_k: int | None = option(None, "Goldfish loss: drop 1 in K targets from the loss, "
                                    "chosen by a hash of the --goldfish-h tokens before each "
                                    "(against verbatim memorization; 2 in the paper)",
                                    minimum=2)
    goldfish_h: int = option(13, "Goldfish loss: tokens of context hashed per target",
                             minimum=1)

    def goldfish(self) -> Goldfish | None:
        """The run's Goldfish mask (None without --goldfish-k)."""
        return Goldfish(self.goldfish_k, self.goldfish_h) if self.goldfish_k else None

    def check_batch_split(self, names: str, degrees: list[int]) -> None:
        """Batches' rule: every data shard takes whole microbatches. `names`: the
        options of the degrees the batch is split over (``G_z*G_data``), `degrees`:
        their values."""
        shards = math.prod(degrees)
        need = shards * self.micro_batch_size
        if self.global_batch_size % need == 0:
            return
        values = "" if len(degrees) == 1 else "*".join(map(str, degrees)) + "="
        split = (f"{names}={values}{shards}" if self.global_batch_size % shards else
                 f"{names}*--micro-batch-size={values.rstrip('=') or shards}*"
                 f"{self.micro_batch_size}={need}")
        raise ValueError(f"--global-batch-size {self.global_batch_size} is not divisible "
                         f"by {split}: every data shard takes whole microbatches of "
                         f"--micro-batch-size {self.micro_batch_size}; choose a multiple of "
                         f"{need} or a smaller --micro-batch-size")

    def data_vocab_size(self) -> int:
        """The vocabulary of --data's tokens (load_dataset's): bytes, or --vocab-size."""
        if _is_stdlib(self.data):
            return ByteCorpus.vocab_size
        if self.vocab_size:
            return self.vocab_size
        try:  # the data's own (meta.json); check_node refuses a bad file by name
            return read_meta(self.data).get("vocab_size") or _TOKEN_VOCAB
        except (OSError, ValueError):
            return _TOKEN_VOCAB

    def check_node(self) -> None:
        if _is_stdlib(self.data):
            return
        train = Path(self.data) / "train.bin"
        if not train.is_file():
            what = "has no train.bin" if Path(self.data).is_dir() else "is no directory"
            raise PathOptionError(f"--data {self.data} {what}; expected 'stdlib' or a "
                                  "directory of train.bin/val.bin token ids")
        try:
            meta, width = read_meta(self.data), token_dtype(self.data).itemsize
        except (OSError, ValueError) as e:
            raise PathOptionError(f"--data {self.data}: unreadable {META} ({e}); rewrite it "
                                  "with 'python -m training.data prepare'") from None
        known = meta.get("vocab_size")
        if self.vocab_size and known and self.vocab_size < known:
            raise PathOptionError(f"--vocab-size {self.vocab_size} is below the vocabulary "
                                  f"of --data {self.data} ({known}, its {META}); give at "
                                  "least that or leave --vocab-size out")
        model = self.model_config()
        tokens = train.stat().st_size // width  # Batches' rule: a sequence and its next token
        if model is not None and tokens <= model.block_size + 1:
            raise PathOptionError(f"--data {self.data}: train.bin holds {tokens} tokens; "
                                  f"expected more than block_size + 1 = "
                                  f"{model.block_size + 1}; give more tokens or a smaller "
                                  "--block-size")
        windows = getattr(self, "eval_windows", None)
        if model is not None and getattr(self, "eval_interval", 0):
            val = Path(self.data) / "val.bin"
            held = val.stat().st_size // width if val.is_file() else 0
            fit = max(0, (held - 1) // model.block_size)
            if fit < (windows or 1):
                raise PathOptionError(f"--eval-interval: --data {self.data}'s val.bin holds "
                                      f"{held} tokens, {fit} windows of block_size "
                                      f"{model.block_size} + 1; --eval-windows "
                                      f"{windows or 1} needs "
                                      f"{(windows or 1) * model.block_size + 1}")



@dataclass
class OptimizerOptions(Options):
    section = "optimizer"
    lr: float = option(1e-3, "peak learning rate", above=0)
    min_lr: float | None = option(None, "learning rate at the end of the cosine decay "
                                  "(default 1e-4, or --lr where that is lower)", minimum=0)
    warmup_steps: int = option(5, "steps of linear warm-up", minimum=0)
    decay_steps: int | None = option(None, "step where the decay reaches --min-lr "
                                     "(default --steps)", minimum=1)
    weight_decay: float = option(0.1, "AdamW weight decay of matrices and embeddings",
                                 minimum=0)
    grad_clip: float = option(1.0, "global gradient norm bound (0: no clipping)", minimum=0)
    offload_optimizer: bool = option(False, "fp32 master weights and Adam states in host "
                                     "memory (always on for bf16/fp16)")
    bucket_mib: float | None = option(None, "gradient bucket size in MiB: the fp32 data-"
                                      "parallel all-reduce buckets (default from the "
                                      "stage's size, up to 25 MiB, the first smaller) and "
                                      "the 4D engine's fused all-reduces (default 4); the "
                                      "offloaded and SAMO optimizers' update buckets "
                                      "(default 4)", above=0)
    coarsening: int = option(2, "buckets per all-reduce chunk", minimum=1)

    def check(self) -> None:
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the decay "
                             "goes from --lr down to --min-lr")

    def optim(self) -> OptimConfig:
        """The optimizers' settings for this run (decay over --steps by default)."""
        return self.optimizer_config(self.steps)

    def optimizer_config(self, total_steps: int) -> OptimConfig:
        """The optimizers' settings for a run of `total_steps` steps."""
        min_lr = min(1e-4, self.lr) if self.min_lr is None else self.min_lr
        return OptimConfig(lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup_steps,
                           decay_steps=self.decay_steps or total_steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           bucket_mib=self.bucket_mib, coarsening=self.coarsening)



def check_backend_names(option: str, given: str, names: list[str]) -> None:
    """ValueError naming `option` when one of `names` is no mcrdl backend (a typo would
    otherwise surface only at init, as a traceback about mcrdl.init)."""
    from mcrdl.backends.registry import known_names

    known = known_names()
    bad = [n.strip() for n in names if n.strip() not in (*known, "auto")]
    if bad:
        raise ValueError(f"{option} {given!r}: unknown backend {bad[0]!r}; mcrdl's backends "
                         f"are {', '.join(known)} (and auto)")



def check_backends_usable(option: str, given: str, names: list[str]) -> None:
    """PathOptionError naming `option` when one of `names` cannot start on this node
    (mcrdl's reason: nccl without a GPU build, ...; a traceback from mcrdl.init on every
    rank otherwise). Only the named backends are probed."""
    from mcrdl.backends import registry
    from mcrdl.launch import detect

    launch = detect()
    for name in (n.strip() for n in names):
        if name == "auto":
            continue
        try:
            why = registry.backend_class(name).availability(launch)
        except Exception as e:  # as registry.availability reports a failed probe
            why = f"availability check failed: {e}"
        if why is not None:
            usable = [n for n, w in registry.availability(launch).items() if w is None]
            raise PathOptionError(f"{option} {given!r}: backend {name!r} is unavailable "
                                  f"here: {why}; usable here: {', '.join(usable)}")


@dataclass
class RunOptions(Options):
    section = "run"
    steps: int = option(20, "training steps", minimum=1)
    dtype: str = option("fp32", "training precision (or float32, bfloat16, float16)",
                        choices=NAMES, parse=dtype_name)
    device: str = option("auto", "torch device ('auto': this rank's GPU if any, else cpu)")
    seed: int = option(1234, "seed of the weights and of the batches", minimum=0)
    backends: str | None = option(None, "mcrdl backends to initialize, comma-separated "
                                  "(default mpi or gloo, plus nccl on GPUs)")
    timeout: float | None = option(None, "seconds before a missing message or rank is an "
                                   "error (default mcrdl's)", minimum=0.001)
    metrics: str | None = option(None, "JSON-lines metrics file (default "
                                 "<out-dir>/metrics.jsonl)")
    out_dir: str = option("runs/gpt", "directory of the metrics and the loss plot")
    checkpoint_dir: str | None = option(None, "directory of the checkpoints")
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)",
                                   minimum=0)
    stop_after: int | None = option(None, "stop (with a checkpoint) after this step")
    resume: str | None = option(None, "resume from --checkpoint-dir's latest checkpoint, or "
                                "from a path", const="latest")
    init_from: str | None = option(None, "start from a serial state_dict (.pt: 'python -m "
                                   "training.checkpoint consolidate' writes one) or a Hugging "
                                   "Face model directory (hf:DIR) instead of "
                                   "--seed's weights; any grid or layout (with --resume, the "
                                   "checkpoint's weights)")
    trust_checkpoint: bool = option(False, TRUST_HELP)
    log_interval: int = option(1, "steps between log lines", minimum=1)
    eval_interval: int = option(0, "steps between validation losses on --data's val split "
                                "(0: none)", minimum=0)
    eval_windows: int | None = option(None, "windows of block_size tokens the validation "
                                      "loss covers (default: the whole val split); window i "
                                      "is tokens [i*T, i*T+T+1)", minimum=1)
    plot: bool = option(True, "save the loss curve as <out-dir>/loss.png")
    progress: bool = option(True, "progress bar on a terminal")
    quiet: bool = option(False, "no start line, step lines or breakdown (benchmarks)")

    @property
    def last_step(self) -> int:
        """The step this run ends after: --stop-after, else --steps."""
        return self.stop_after or self.steps

    @property
    def metrics_path(self) -> Path:
        """--metrics, else <out-dir>/metrics.jsonl."""
        return Path(self.metrics or Path(self.out_dir) / "metrics.jsonl")

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after `step` (1-based)."""
        if not self.checkpoint_dir:
            return False
        every = self.checkpoint_every and step % self.checkpoint_every == 0
        return bool(every) or step == self.last_step

    def check(self) -> None:
        if self.backends:  # names, or KIND=NAME pins (train_moe): every name it initializes
            check_backend_names("--backends", self.backends,
                                Backends.parse(self.backends).init)
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after {self.stop_after}: expected 1..--steps ({self.steps})")
        if (self.checkpoint_every or self.stop_after) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every/--stop-after need --checkpoint-dir")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise ValueError("--resume without a path needs --checkpoint-dir")
        if self.eval_windows and not self.eval_interval:
            raise ValueError("--eval-windows needs --eval-interval N (steps between "
                             "validation losses)")

    def check_node(self) -> None:
        if self.backends:
            check_backends_usable("--backends", self.backends,
                                  Backends.parse(self.backends).init)
        if self.init_from is not None and self.init_from.startswith(HF_PREFIX):
            hf_dir = Path(self.init_from.removeprefix(HF_PREFIX))
            if not (hf_dir / "config.json").is_file():
                raise PathOptionError(f"--init-from {self.init_from}: {hf_dir} has no "
                                      "config.json; expected a Hugging Face model directory "
                                      "(config.json and safetensors weights)")
        elif self.init_from is not None and not Path(self.init_from).is_file():
            raise PathOptionError(f"--init-from {self.init_from}: no such file; expected a "
                                  "serial state_dict (.pt) or hf:DIR")
        if self.resume == "latest" and latest_checkpoint(self.checkpoint_dir) is None:
            raise PathOptionError(f"--resume: no complete checkpoint in --checkpoint-dir "
                                  f"{self.checkpoint_dir}; expected one an earlier run saved "
                                  "there; drop --resume to start at step 0, or give the "
                                  "directory that holds the checkpoints")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise PathOptionError(f"--resume {self.resume}: no such checkpoint directory; "
                                  "expected a step directory a run saved (or --resume alone "
                                  "for --checkpoint-dir's latest)")
        if self.plot or not self.metrics:  # else nothing goes to --out-dir
            check_directory("--out-dir", self.out_dir)
        if self.checkpoint_dir:
            check_directory("--checkpoint-dir", self.checkpoint_dir)
        check_file("--metrics" if self.metrics else "--out-dir", self.metrics_path)
