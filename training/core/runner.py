"""What every training command (``train_gpt``, ``train_moe``) shares: the step loop
(``train_loop``: resume, metrics file, progress, warm-up step, checkpoints, wall time)
and the command around the run (``run_command``: parse the options, run, finalize
mcrdl, and turn the errors a user can fix into exit codes with one line on stderr
instead of a traceback from every rank):

- 0: trained; 2: bad options or a layout the world cannot hold; 3: an unusable
  checkpoint (``--resume``). Anything else (a bug, a GPU out of memory on one rank)
  propagates with its traceback; on a world of several ranks the failing rank then
  exits at once (1) instead of finalizing mcrdl, which is collective: the others would
  wait for it up to the timeout while the launcher could already end the job.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import mcrdl
from mcrdl.api import current_runtime
from mcrdl.launch import detect as detect_launch

from . import report
from .checkpoint import CheckpointError, resume_path
from .data import eval_windows
from .flops import model_flops_per_token, peak_flops
from .options import PathOptionError, UsageError
from .report import MetricsFile, ProgressLog, TrainResult
from .sigterm import SigtermGuard
from .validate import print_traceback, refuse_together


def _rank() -> str:
    return str(mcrdl.get_rank()) if mcrdl.is_initialized() else "?"


def report_option_error(e: Exception) -> None:
    """Print a refused command line before mcrdl starts, once per job where it is the
    same on every rank: an error that follows from the command line alone (every rank
    has the same) is printed by the launch's rank 0 only; one about a path or a
    --config file's contents (PathOptionError, a missing --config file) by each rank,
    named, since nodes may see different file systems."""
    launch = detect_launch()
    if isinstance(e, LOCAL_ERRORS):
        who = f" (rank {launch.rank})" if launch.size > 1 else ""
        print_traceback(e)
        print(f"error{who}: {e}", file=sys.stderr, flush=True)
    elif launch.rank == 0:
        print_traceback(e)
        usage = e.usage if isinstance(e, UsageError) else ""
        print(f"{usage}{e}" if usage else f"error: {e}", file=sys.stderr, flush=True)


#: The refusals of this node's files (report_option_error): a launch's ranks may differ.
LOCAL_ERRORS = (PathOptionError, FileNotFoundError)


def run_command(parse_args: Callable[[Sequence[str] | None], Any], run: Callable[[Any], Any],
                argv: Sequence[str] | None, *, layout_errors: tuple[type[Exception], ...],
                layout_errors_agree: bool, gather_refusals: bool = False) -> int:
    """``run(parse_args(argv))`` with the module's exit codes. ``layout_errors``: the
    exceptions that name a layout the world cannot hold (exit 2); when
    ``layout_errors_agree`` every rank raises the same one and only rank 0 prints it,
    else every rank prints its own, prefixed with its rank. `parse_args` is the
    validation pass: it checks every rule of the command line and the world before
    this node's (its paths and backends), so its errors other than LOCAL_ERRORS are the
    same on every rank (the launch's rank 0 prints them). With `gather_refusals` and
    several ranks, the ranks then agree on LOCAL_ERRORS before the run
    (validate.refuse_together: printed once, with the ranks they concern); without it,
    each rank prints its own."""
    cfg, local = None, None
    gather = gather_refusals and detect_launch().size > 1
    try:
        cfg = parse_args(argv)
    except LOCAL_ERRORS as e:
        if not gather:
            report_option_error(e)
            return 2
        local = e
    except ValueError as e:
        report_option_error(e)
        return 2
    try:
        if gather and refuse_together(local, getattr(cfg, "timeout", None)):
            return 2
        run(cfg)
    except CheckpointError as e:
        if not e.agreed:
            print(f"error (rank {_rank()}): {e}", file=sys.stderr, flush=True)
        elif e.reporter:  # the same on every rank of the run: its rank 0 reports it
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except layout_errors as e:
        if not layout_errors_agree:
            print(f"error (rank {_rank()}): {e}", file=sys.stderr, flush=True)
        elif not mcrdl.is_initialized() or mcrdl.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:
        if mcrdl.is_initialized() and mcrdl.get_size() > 1:
            # the others may be waiting for this rank: no collective finalize
            print(f"rank {_rank()} failed:", file=sys.stderr)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise
    finally:
        if current_runtime() is not None:  # also the bootstrap alone
            mcrdl.finalize()
    return 0


def train_loop(trainer, cfg, result: TrainResult, *, nan_hint: str,
               on_warmup_end: Callable[[], None] = lambda: None,
               on_step: Callable[[], None] = lambda: None,
               line_suffix: Callable[[dict], str] = lambda record: "") -> tuple[float, int]:
    """Resume if ``cfg.resume``, then train ``trainer`` to ``cfg.last_step``: rank 0 writes
    the metrics file and the progress lines (``line_suffix(record)`` appended), a
    checkpoint is saved when due, a non-finite loss stops the run (``nan_hint`` says
    what to change). The first step is warm-up: the timers restart after it
    (``on_warmup_end`` runs then). ``on_step`` runs after every step, on every rank.
    SIGTERM (a batch system's end of the job) ends the rank, never inside a checkpoint
    save (training/core/sigterm.py). With --goldfish-k the trainer's batches drop the
    Goldfish targets (every engine draws its batches from core.data.Batches) and the
    records hold the fraction kept (``goldfish_kept``); with --eval-interval N every rank
    calls ``trainer.evaluate`` on the val split's windows after every N-th step and the
    last (``val_loss``, in the record, the log line and ``result.val_losses``); the
    evaluation is outside the step's time. Returns (wall seconds, steps) of the timed
    steps."""
    goldfish = cfg.goldfish() if hasattr(cfg, "goldfish") else None
    if goldfish is not None and trainer.batches.goldfish is None:
        trainer.batches.goldfish = goldfish
    elif goldfish != trainer.batches.goldfish:
        raise ValueError(f"the trainer's batches use {trainer.batches.goldfish}, the options "
                         f"{goldfish}: build its Batches with goldfish=cfg.goldfish()")
    val = None
    if getattr(cfg, "eval_interval", 0):
        if not hasattr(trainer, "evaluate"):
            raise ValueError(f"--eval-interval: {type(trainer).__name__} has no evaluate(); "
                             "drop --eval-interval and run 'python -m training.evaluate' on "
                             "a checkpoint")
        val = eval_windows(trainer.dataset.splits["val"], cfg.eval_windows,
                           trainer.model_cfg.block_size, "--eval-windows")
    trainer.layout_choice = getattr(result, "layout", None)  # into its checkpoints
    if cfg.resume:
        result.start_step = trainer.load_checkpoint(cfg.resume)
    is_rank0 = trainer.world_rank == 0
    verbose = is_rank0 and not cfg.quiet
    if verbose:
        print(trainer.describe(), flush=True)
        if cfg.resume:
            where = resume_path(cfg.resume, cfg.checkpoint_dir)
            print(f"resumed from {where} at step {result.start_step}", flush=True)
        elif cfg.init_from:
            print(f"weights from --init-from {cfg.init_from}", flush=True)
    metrics = MetricsFile(cfg.metrics_path, result.start_step) if is_rank0 else None
    progress = ProgressLog(cfg.last_step - result.start_step, lines=verbose,
                           bar=verbose and cfg.progress)
    tokens_per_step = cfg.global_batch_size * trainer.model_cfg.block_size
    # model flop/s and MFU (training/core/flops.py): rank 0 writes the records
    flops_per_step, peak = 0.0, None
    if is_rank0:
        flops_per_step = tokens_per_step * model_flops_per_token(
            trainer.model_cfg, cfg.moe_config() if hasattr(cfg, "moe_config") else None)
        peak, peak_source = peak_flops(trainer.device, getattr(cfg, "peak_flops", None))
        if verbose:
            print(f"MFU against {peak / 1e9:,.1f} GFLOP/s per rank ({peak_source}) x "
                  f"{trainer.world_size} ranks", flush=True)
    if is_rank0 and getattr(result, "layout", None):
        metrics.write({"step": result.start_step, "layout_choice": result.layout})
    timed_since, timed_from_step = time.perf_counter(), result.start_step
    sigterm = SigtermGuard(trainer.world_rank, lambda: trainer.step)
    sigterm.install()
    try:
        while trainer.step < cfg.last_step:
            if trainer.step == result.start_step + 1:  # the run's first step is warm-up
                trainer.timers.reset()
                on_warmup_end()
                timed_since, timed_from_step = time.perf_counter(), trainer.step
            step_start = time.perf_counter()
            loss, applied = trainer.train_step()
            step_time = time.perf_counter() - step_start
            result.losses.append((trainer.step, loss))
            on_step()
            val_loss = None
            if val is not None and (trainer.step % cfg.eval_interval == 0
                                    or trainer.step == cfg.last_step):
                val_loss = trainer.evaluate(val)
                result.val_losses.append((trainer.step, val_loss))
            if is_rank0:
                record = trainer.metrics_record(loss, step_time, tokens_per_step, applied)
                record["model_flops_per_s"] = flops_per_step / step_time
                record["mfu"] = record["model_flops_per_s"] / (peak * trainer.world_size)
                if goldfish is not None:
                    record["goldfish_kept"] = trainer.batches.kept_fraction(trainer.step - 1)
                if val_loss is not None:
                    record["val_loss"] = val_loss
                metrics.write(record)
                if (trainer.step % cfg.log_interval == 0 or trainer.step == cfg.last_step
                        or val_loss is not None):
                    progress.log(report.step_line(record, cfg.steps) + line_suffix(record))
                progress.advance()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {trainer.step}; {nan_hint}")
            if cfg.checkpoint_due(trainer.step):
                with sigterm.saving():
                    directory = trainer.save_checkpoint()
                progress.log(f"checkpoint {directory}")
    finally:
        sigterm.uninstall()
        progress.close()
        if metrics:
            metrics.close()
    return time.perf_counter() - timed_since, trainer.step - timed_from_step
