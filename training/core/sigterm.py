"""SIGTERM, the end a batch system gives a run: Slurm sends it at the job's time limit,
on ``scancel`` and on preemption, and SIGKILL after its grace period (``KillWait``, 30 s
by default). The trainers end at once on it, but never inside a checkpoint save.

Outside a save the rank ends at once (exit code 143), wherever it waits (a thread
watches for the signal: Python runs its handlers only when the main thread returns from
a blocking call, which a rank waiting for a peer does not): its metrics file holds every
finished step (written and flushed per step), and the newest complete checkpoint is
intact (saves are published atomically: training/core/checkpoint.py). Inside a save the
signal waits until the save is published, then the rank ends: a save every rank is in
when the signal comes completes, where the grace period allows. Where SIGKILL comes
first, or another rank ended before joining the save, the save is abandoned in its
staging directory, which loaders ignore and the next save of that step removes."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SigtermGuard:
    """Ends this rank on SIGTERM, holding the signal during :meth:`saving`. `rank` and
    `step` (the trainer's current step) name the end in rank 0's message. Installed by
    :meth:`install` from the main thread (where Python's signal handlers are set), put
    back by :meth:`uninstall`; a no-op elsewhere."""

    def __init__(self, rank: int, step: Callable[[], int]):
        self.rank, self.step = rank, step
        self._lock = threading.Lock()
        self._saving = self._pending = False
        self._previous: tuple | None = None  # (SIGTERM handler, wakeup fd) to put back
        self._write_fd = -1

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        # Python's handler does nothing (it would run late); the signal's number, written
        # to the wakeup fd by the C-level handler at once, wakes the watching thread.
        handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = (handler, wakeup)
        threading.Thread(target=self._watch, args=(read_fd,), name="sigterm-guard",
                         daemon=True).start()

    def uninstall(self) -> None:
        if self._previous is None:
            return
        handler, wakeup = self._previous
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGTERM, handler)
        os.close(self._write_fd)  # the watching thread reads the end and leaves
        self._previous = None

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint save: SIGTERM during it ends the rank once it is published."""
        with self._lock:
            self._saving = True
        try:
            yield
        finally:
            with self._lock:
                self._saving = False
                pending = self._pending
        if pending:
            self._end("after publishing the checkpoint it was saving")

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                if signal.SIGTERM in data:
                    with self._lock:
                        self._pending = self._saving
                        if self._pending:
                            continue
                    self._end("outside a checkpoint save; the newest complete checkpoint "
                              "is intact")

    def _end(self, how: str) -> None:
        if self.rank == 0:
            print(f"SIGTERM at step {self.step()}: ending ({how})", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)
