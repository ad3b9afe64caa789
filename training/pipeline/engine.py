"""AxoNN's message-driven pipeline (Singh & Bhatele, IPDPS 2022; dissertation Algorithm 2).

A row of the process grid holds the pipeline: stage s owns a contiguous range of the
model's units. Nothing follows a fixed schedule; every stage reacts to messages:

- Receives are posted ahead: each stage keeps a receive posted for every activation it
  can still get from stage s-1 (up to ``pipeline_limit``) and for the gradient of
  every microbatch it has sent forward to stage s+1.
- The stage then repeatedly takes *whichever posted receive completes first* (an
  activation -> forward, send the output on; a gradient -> backward, send the input
  gradient back) and immediately re-posts.
- Stage 0 keeps ``pipeline_limit`` microbatches in flight: it injects a new one each
  time a backward pass of an earlier one completes on it.
- The last stage runs the loss and the backward pass right after each forward.

Waiting for the next message: when only one posted receive can complete next (the
first stage waits only for gradients, the last only for activations, an inner stage
when one of its queues is empty) the stage waits on it with the backend's own wait,
except on mcrdl's lanes (``mcrdl._C.Work``: mpi, cray-mpich, pccl), whose waits poll
(spin, then yield; docs/api.md): those, and any wait for whichever of two receives
completes first, are polled here with sleeps, so that a waiting stage leaves the core
to the stage it waits for. Gloo's wait blocks in the kernel and NCCL's orders the
compute stream after the receive without holding the CPU.

Receive buffers come from a pool kept across steps (an activation's buffer returns to
it after that microbatch's backward pass, a gradient's after the backward that used
it): no allocation per message.

Per (source, direction) messages arrive in issue order (MPI's non-overtaking rule holds
per communicator, source and tag, and every stage forwards in arrival order), so each
posted receive names the microbatch it expects through its tag
(``2 * microbatch + direction``): a mismatch shows up as a timeout naming the stage and
the microbatch instead of silently training on the wrong activation.

Time is charged to phases: ``compute`` (forward/backward), ``p2p`` (posting sends and
receives, waiting for sends at the end), ``bubble`` (waiting for the next message).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

import torch

import mcrdl

from ..core.timers import NullTimers, PhaseTimers
from ..models.gpt import lm_loss

FWD, BWD = 0, 1
MAX_MICROBATCHES = 16383  # tags 2*mb+dir stay below the MPI minimum tag bound 32767


class PipelineError(RuntimeError):
    pass


def partition(n_layer: int, stages: int, blocks_per_stage=None) -> list[tuple[int, int]]:
    """Unit ranges (first, last) per stage. Units: 0 embedding, 1..n_layer blocks,
    n_layer+1 head. ``blocks_per_stage`` (e.g. [2, 1, 1]) may be uneven; by default the
    blocks are spread as evenly as possible, the first stages taking the remainder."""
    if stages < 1:
        raise ValueError(f"pipeline stages {stages}; expected >= 1")
    if blocks_per_stage is None:
        if n_layer < stages:
            raise ValueError(f"cannot cut {n_layer} transformer blocks into {stages} pipeline "
                             f"stages; use --G-inter <= {n_layer} or a deeper model")
        base, extra = divmod(n_layer, stages)
        blocks_per_stage = [base + (1 if s < extra else 0) for s in range(stages)]
    blocks_per_stage = [int(b) for b in blocks_per_stage]
    if len(blocks_per_stage) != stages or sum(blocks_per_stage) != n_layer:
        raise ValueError(f"--layers-per-stage {blocks_per_stage} must have {stages} entries "
                         f"summing to n_layer={n_layer}")
    for s, b in enumerate(blocks_per_stage):
        if b < 0 or (b == 0 and 0 < s < stages - 1):
            raise ValueError(f"--layers-per-stage {blocks_per_stage}: stage {s} would hold no "
                             "unit; inner stages need at least one block")
    out, unit = [], 1
    for s, b in enumerate(blocks_per_stage):
        first = 0 if s == 0 else unit
        last = unit + b - 1 + (1 if s == stages - 1 else 0)
        if s == stages - 1:
            last = n_layer + 1
        out.append((first, last))
        unit += b
    if stages == 1:
        out = [(0, n_layer + 1)]
    return out


@dataclass
class Event:
    """One message processed by a stage (for tests and traces)."""
    kind: str        # "F" forward, "B" backward, "I" injected by stage 0
    microbatch: int
    ready: float     # when its receive was seen complete (perf_counter)
    start: float     # when processing started


class PipelineEngine:
    """Runs the microbatches of one step through `model_stage`, stage `stage_index` of
    `n_stages`; `group` is the pipeline's group, in which a stage's rank is its index.
    `backward_group` (the same ranks on communicators of their own; default `group`)
    carries the gradients: NCCL has no tags and runs a pair's sends and receives of one
    communicator in issue order on one stream, so a receive posted ahead for the next
    activation would hold up a gradient sent back (a deadlock at two stages)."""

    def __init__(self, model_stage: torch.nn.Module, *, stage_index: int, n_stages: int, group,
                 p2p_backend: str, micro_batch: int, pipeline_limit: int | None = None,
                 timers: PhaseTimers | None = None, timeout: float | None = None,
                 compute_delay: float = 0.0, record: bool = False, backward_group=None):
        self.model_stage, self.group = model_stage, group
        self.groups = {FWD: group, BWD: group if backward_group is None else backward_group}
        self.stage_index, self.n_stages = stage_index, n_stages
        self.backend = p2p_backend
        self.first, self.last = stage_index == 0, stage_index == n_stages - 1
        self.micro_batch = micro_batch
        self.limit = pipeline_limit or 2 * n_stages
        if self.limit < 1:
            raise ValueError(f"pipeline_limit {pipeline_limit}; expected >= 1")
        cfg = model_stage.cfg
        self.act_shape = (micro_batch, cfg.block_size, cfg.n_embd)
        self.act_dtype = next(model_stage.parameters()).dtype
        self.device = next(model_stage.parameters()).device
        self.timers = timers or NullTimers()
        self.timeout = timeout if timeout is not None else float(
            os.environ.get("MCRDL_TIMEOUT", 300))
        self.compute_delay = compute_delay  # tests: an artificially slow stage
        self.record = record
        self.events: list[Event] = []
        self.loss_scale = 1.0
        self._free: list[torch.Tensor] = []  # receive buffers not in use (act_shape)

    # --- messages ------------------------------------------------------------------------
    def _buffer(self) -> torch.Tensor:
        """A receive buffer from the pool (a new one when every one is in use)."""
        if self._free:
            return self._free.pop()
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)

    def _release(self, buf: torch.Tensor, sent: torch.Tensor | None) -> None:
        """Return `buf` to the pool once its microbatch is done with it, unless the
        gradient `sent` (still in flight) shares its memory (a stage whose output is its
        input passes the received gradient through)."""
        if sent is None or sent.untyped_storage().data_ptr() != \
                buf.untyped_storage().data_ptr():
            self._free.append(buf)

    def _post_recv(self, queue: deque, mb: int, direction: int) -> None:
        buf = self._buffer()
        peer = self.stage_index - 1 if direction == FWD else self.stage_index + 1
        with self.timers("p2p"):
            w = mcrdl.recv(self.backend, buf, src=peer, tag=2 * mb + direction,
                           group=self.groups[direction], async_op=True)
        queue.append((mb, buf, w))

    def _send(self, t: torch.Tensor, mb: int, direction: int) -> None:
        peer = self.stage_index + 1 if direction == FWD else self.stage_index - 1
        t = t.detach().contiguous()
        with self.timers("p2p"):
            w = mcrdl.send(self.backend, t, dst=peer, tag=2 * mb + direction,
                           group=self.groups[direction], async_op=True)
        self._sends.append((w, t))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def _waiting_for(self, fwd_q: deque, bwd_q: deque) -> str:
        return ", ".join(
            [f"activation of microbatch {fwd_q[0][0]} from stage {self.stage_index - 1}"] *
            bool(fwd_q) +
            [f"gradient of microbatch {bwd_q[0][0]} from stage {self.stage_index + 1}"] *
            bool(bwd_q))

    def _next_message(self, fwd_q: deque, bwd_q: deque):
        """Block until the first of the posted receives completes; return it."""
        t0 = time.perf_counter()
        if not (fwd_q and bwd_q):  # one receive can complete next
            kind, q = ("B", bwd_q) if bwd_q else ("F", fwd_q)
            if not isinstance(q[0][2], mcrdl._C.Work):  # its wait does not poll
                mb, buf, w = q[0]
                try:
                    w.wait()  # bounded by the op's own timeout (init's)
                except mcrdl.CommTimeoutError as e:
                    raise PipelineError(f"pipeline stage {self.stage_index}: no message "
                                        f"within the timeout; waiting for "
                                        f"{self._waiting_for(fwd_q, bwd_q)}") from e
                q.popleft()
                now = time.perf_counter()
                self.timers.add("bubble", now - t0)
                return kind, mb, buf, now
        delay = 1e-5
        while True:
            for kind, q in (("B", bwd_q), ("F", fwd_q)):
                if q and q[0][2].is_completed():
                    mb, buf, w = q.popleft()
                    w.wait()
                    now = time.perf_counter()
                    self.timers.add("bubble", now - t0)
                    return kind, mb, buf, now
            if time.perf_counter() - t0 > self.timeout:
                raise PipelineError(f"pipeline stage {self.stage_index}: no message within "
                                    f"{self.timeout:.0f} s; waiting for "
                                    f"{self._waiting_for(fwd_q, bwd_q)}")
            time.sleep(delay)
            delay = min(2 * delay, 2e-4)

    # --- compute -------------------------------------------------------------------------
    def _forward(self, mb: int, x: torch.Tensor, target: torch.Tensor | None):
        with self.timers("compute"):
            if self.compute_delay:
                time.sleep(self.compute_delay)
            if not self.first:
                x.requires_grad_(True)
            out = self.model_stage(x)
            if not self.last:
                return out, None
            loss = lm_loss(out, target) / self.n_micro
            (loss if self.loss_scale == 1.0 else loss * self.loss_scale).backward()
            return out, loss.detach()

    def run(self, microbatches) -> float:
        """Forward and backward of every microbatch of one step (gradients accumulate in
        the stage's parameters). ``microbatches``: the (inputs, targets) pairs of this
        data-parallel rank; only the first stage uses the inputs and only the last the
        targets. Returns the sum over microbatches of loss/M on the last stage, else 0."""
        n_micro = self.n_micro = len(microbatches)
        if not 1 <= n_micro <= MAX_MICROBATCHES:
            raise ValueError(f"{n_micro} microbatches per step; expected "
                             f"1..{MAX_MICROBATCHES}")
        self._sends = deque()
        self.events = []
        fwd_q, bwd_q = deque(), deque()
        stored: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), dtype=torch.float32)
        posted_fwd = injected = done = 0
        if not self.first:
            while posted_fwd < min(self.limit, n_micro):
                self._post_recv(fwd_q, posted_fwd, FWD)
                posted_fwd += 1

        def forward(mb, x, kind, ready):
            nonlocal loss_sum, done
            if self.record:
                self.events.append(Event(kind, mb, ready, time.perf_counter()))
            # a received activation: a leaf of its own over the pooled buffer `x`
            x_dev = x.to(self.device) if self.first else x.detach()
            out, loss = self._forward(mb, x_dev, microbatches[mb][1].to(self.device)
                                      if self.last else None)
            if self.last:
                loss_sum += loss.float().cpu()
                if not self.first:
                    self._send(x_dev.grad, mb, BWD)
                    self._release(x, x_dev.grad)  # its backward pass has run
                done += 1
            else:
                self._send(out, mb, FWD)
                stored[mb] = (None if self.first else (x, x_dev), out)
                self._post_recv(bwd_q, mb, BWD)

        while done < n_micro:
            if self.first:  # keep pipeline_limit microbatches in flight
                while injected < n_micro and injected - done < self.limit:
                    now = time.perf_counter()
                    forward(injected, microbatches[injected][0], "I", now)
                    injected += 1
                if done == n_micro:
                    break
            kind, mb, buf, ready = self._next_message(fwd_q, bwd_q)
            if kind == "F":
                forward(mb, buf, "F", ready)
                if posted_fwd < n_micro:
                    self._post_recv(fwd_q, posted_fwd, FWD)
                    posted_fwd += 1
            else:
                if self.record:
                    self.events.append(Event("B", mb, ready, time.perf_counter()))
                x, out = stored.pop(mb)
                with self.timers("compute"):
                    if self.compute_delay:
                        time.sleep(self.compute_delay)
                    out.backward(buf)
                grad = None if self.first else x[1].grad
                if not self.first:
                    self._send(grad, mb, BWD)
                    self._release(x[0], grad)
                self._release(buf, grad)
                done += 1
        with self.timers("p2p"):
            while self._sends:
                w, _ = self._sends.popleft()
                w.wait()
        if stored or fwd_q or bwd_q:
            raise PipelineError(f"pipeline stage {self.stage_index}: step ended with "
                                f"{len(stored)} stored activations, {len(fwd_q)} + "
                                f"{len(bwd_q)} posted receives (internal error)")
        return float(loss_sum)
