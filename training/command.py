"""What every training command (``train_gpt``, ``train_moe``) does around its run: parse
the options, run, finalize mcrdl, and turn the errors a user can fix into exit codes
with one line on stderr instead of a traceback from every rank:

- 0: trained; 2: bad options or a layout the world cannot hold; 3: an unusable
  checkpoint (``--resume``). Anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import mcrdl

from .checkpoint import CheckpointError


def _rank() -> str:
    return str(mcrdl.get_rank()) if mcrdl.is_initialized() else "?"


def run_command(parse_args: Callable[[Sequence[str] | None], Any], run: Callable[[Any], Any],
                argv: Sequence[str] | None, *, layout_errors: tuple[type[Exception], ...],
                layout_errors_agree: bool) -> int:
    """``run(parse_args(argv))`` with the module's exit codes. ``layout_errors``: the
    exceptions that name a layout the world cannot hold (exit 2); when
    ``layout_errors_agree`` every rank raises the same one and only rank 0 prints it,
    else every rank prints its own, prefixed with its rank."""
    try:
        cfg = parse_args(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except CheckpointError as e:
        print(f"error (rank {_rank()}): {e}", file=sys.stderr, flush=True)
        return 3
    except layout_errors as e:
        if not layout_errors_agree:
            print(f"error (rank {_rank()}): {e}", file=sys.stderr, flush=True)
        elif not mcrdl.is_initialized() or mcrdl.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if mcrdl.is_initialized():
            mcrdl.finalize()
    return 0
