"""Argument types of the training package's argparse commands (the model commands,
``python -m training.parallel4d.perf_model`` and ``python -m training.ted.cost_model``):
each raises argparse's error with what it expected."""

from __future__ import annotations

import argparse
import math

from .dtypes import dtype_name


def _number(text: str, kind: type, ok, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a positive number")


def non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < math.inf, "a number >= 0")


def dtype(text: str) -> str:
    """A precision in either spelling (``bf16`` or ``bfloat16``), as its short name."""
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
