"""The training precisions, one spelling parser for every training command: ``fp32``,
``bf16`` and ``fp16``, or torch's names ``float32``, ``bfloat16`` and ``float16``.
A run records and prints the short name (checkpoints compare it)."""

from __future__ import annotations

#: Short name -> torch's name (``torch.<name>``) of each training precision.
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: Bytes per element of each precision.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NAMES = tuple(TORCH_NAMES)
_ALIASES = {**{n: n for n in NAMES}, **{torch: n for n, torch in TORCH_NAMES.items()}}


def dtype_name(text: str) -> str:
    """The short name of precision `text` (``"bfloat16"`` -> ``"bf16"``); ValueError
    naming `text` and listing the accepted spellings."""
    name = _ALIASES.get(text)
    if name is None:
        raise ValueError(f"{text!r}: expected one of "
                         + ", ".join(f"{n} ({TORCH_NAMES[n]})" for n in NAMES))
    return name


def torch_dtype(name: str):
    """The torch dtype of precision `name` (either spelling)."""
    import torch

    return getattr(torch, TORCH_NAMES[dtype_name(name)])
