"""Message sizes on the command line and in tables: K/M/G suffixes (powers of 1024),
geometric sweeps, and the sweep options shared by mcrdl-bench, mcrdl-tune and the
benchmarks."""

from __future__ import annotations

import argparse
import re

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional K, M or G suffix (powers of 1024)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a non-negative integer with an optional "
            "suffix K, M or G (powers of 1024), e.g. 8, 4K, 64M, 1G"
        )
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """``nbytes`` with the largest exact binary suffix (``4096`` -> ``"4K"``)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_range(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric sweep ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` inclusive."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def add_size_sweep_args(parser: argparse.ArgumentParser, factor: int,
                        factor_note: str = "") -> None:
    """--min-bytes, --max-bytes (K/M/G suffixes) and --factor, shared by mcrdl-bench,
    mcrdl-tune and benchmarks/overhead.py; check them with check_size_sweep."""
    parser.add_argument("--min-bytes", type=parse_size, default=8, metavar="SIZE",
                        help="smallest size, suffixes K/M/G allowed (default 8)")
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20, metavar="SIZE",
                        help="largest size, suffixes K/M/G allowed (default 64M)")
    parser.add_argument("--factor", type=int, default=factor,
                        help=f"multiplicative step between sizes, integer >= 2 "
                             f"(default {factor}){factor_note}")


def check_size_sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with status 2 and a message when the sweep options are inconsistent."""
    if args.min_bytes < 1:
        parser.error("--min-bytes must be at least 1 byte")
    if args.min_bytes > args.max_bytes:
        parser.error(
            f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})"
        )
    if args.factor < 2:
        parser.error(f"--factor must be an integer >= 2, got {args.factor}")
