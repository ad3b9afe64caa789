"""``--init-from``'s weights as one interface for every engine: a serial state_dict
file (.pt, ``python -m training.checkpoint consolidate``'s output) or a Hugging Face
model directory (``hf:DIR``, training/models/hf.py).

:func:`read_init` is collective over the run's group: every rank opens the source and
checks it against this run's serial model (names and shapes; a problem on any rank is
a CheckpointError on all of them, naming the tensor). A rank then takes only what it
holds: :meth:`SerialSource.part` (a tensor, or a slice of it in our layout, full shape)
or :meth:`SerialSource.load_into` (every tensor of a stage, unit or expert whole). A
Hugging Face source reads each piece through safetensors slices, so a rank reads (and
holds) its share of the weights, never the whole model; a .pt file is read whole on
every rank (torch.load has no partial read).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

import mcrdl

from ..core import checkpoint as ckpt
from ..core.run_options import HF_PREFIX
from ..core.runtime import raise_together

__all__ = ["HF_PREFIX", "SerialSource", "read_init"]

OPTION = "--init-from"


class SerialSource:
    """The whole serial model's tensors under our names (``units.<i>.<...>``), read on
    demand. Use as a context manager, or call :meth:`close`."""

    spec: str

    def names(self) -> list[str]:
        """Every tensor name of the serial model, in the model's order."""
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name` in our layout."""
        raise NotImplementedError

    def part(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or its part at `index` (a tuple of slices of the full shape,
        our layout), as a tensor of its own (contiguous, not a view of the source)."""
        return self.parts({name: index})[name]

    def parts(self, wanted: dict[str, tuple[slice, ...] | None]) -> dict[str, torch.Tensor]:
        """:meth:`part` of several tensors at once: name -> index (None: whole)."""
        raise NotImplementedError

    def load_into(self, module: nn.Module, prefix: str = "") -> None:
        """Load `module` (a stage, a unit, one expert): each name ``k`` of its
        state_dict from the source's ``prefix + k``, whole."""
        names = list(module.state_dict())
        state = self.parts({prefix + k: None for k in names})
        module.load_state_dict({k: state[prefix + k] for k in names})

    def close(self) -> None:
        pass

    def __enter__(self) -> SerialSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, template: nn.Module) -> None:
        """CheckpointError naming ``--init-from`` and what differs between the source
        and `template` (the run's serial model, on the meta device): a name missing or
        extra, or a shape."""
        want = {k: tuple(v.shape) for k, v in template.state_dict().items()}
        have = {k: self.shape(k) for k in self.names()}
        problems = []
        missing = [k for k in want if k not in have]
        extra = [k for k in have if k not in want]
        for what, names in (("lacks", missing), ("has names this model lacks:", extra)):
            if names:
                problems.append(f"{what} {', '.join(names[:3])}"
                                + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        shapes = [f"{k} is {have[k]}, this model's {v}" for k, v in want.items()
                  if k in have and have[k] != v]
        if shapes:
            problems.append("; ".join(shapes[:3]) + (f" and {len(shapes) - 3} more"
                                                     if len(shapes) > 3 else ""))
        if problems:
            raise ckpt.CheckpointError(
                f"{OPTION} {self.spec} does not fit this run's model: " + "; ".join(problems)
                + " (give the model options it was trained with)")


class _StateDictSource(SerialSource):
    """A serial state_dict read whole (a .pt file)."""

    def __init__(self, spec: str, state: dict[str, torch.Tensor]):
        self.spec, self._state = spec, state

    def names(self) -> list[str]:
        return list(self._state)

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def parts(self, wanted: dict[str, tuple[slice, ...] | None]) -> dict[str, torch.Tensor]:
        out = {}
        for name, index in wanted.items():
            t = self._state[_known(self, name)]
            out[name] = t[index].clone() if index is not None else t
        return out

    def close(self) -> None:
        self._state = {}


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class _Stored:
    """Where a tensor lies in a safetensors file: its dtype, shape and first byte."""
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def _safetensors_header(path: str) -> dict[str, _Stored]:
    """The tensors of safetensors file `path` (its header: a little-endian u64 length,
    then JSON name -> {dtype, shape, data_offsets}; the data follows it)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ckpt.CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, "
                                       f"which this reader does not take")
        out[name] = _Stored(path, dtype, tuple(info["shape"]),
                            8 + length + info["data_offsets"][0])
    return out


class _HFSource(SerialSource):
    """A Hugging Face directory. Each read takes the rows of the slice it needs from
    the safetensors file with os.pread (no memory map: pages a slice touched would stay
    in this process's resident set until the file is closed), then cuts the other
    dimensions, so that a rank holds its share plus one tensor's rows in flight."""

    def __init__(self, spec: str, directory: str):
        from .hf import INDEX, WEIGHTS, HFCheckpoint

        self.spec = spec
        with HFCheckpoint(directory) as hf:  # config, name map and shard checks
            self.config, self.moe = hf.config, getattr(hf, "moe", None)
            maps = hf.tensor_maps()
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = [WEIGHTS]
        stored: dict[str, _Stored] = {}
        for name in files:
            stored.update(_safetensors_header(os.path.join(directory, name)))
        self._maps: dict[str, tuple[_Stored, bool]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for m in maps:
            hf_name = m.hf_name if m.hf_name in stored else m.fallback
            if hf_name not in stored:
                raise ckpt.CheckpointError(f"{OPTION} {spec}: tensor {m.hf_name} is missing "
                                           f"from the weights (needed for our {m.name})")
            s = stored[hf_name]
            self._maps[m.name] = (s, m.transposed)
            self._shapes[m.name] = s.shape[::-1] if m.transposed else s.shape
        self._fds: dict[str, int] = {}

    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[_known(self, name)]

    def _read(self, s: _Stored, index: tuple[slice, ...]) -> torch.Tensor:
        """`index` (of the stored layout) of the tensor `s`: the rows its first slice
        spans, read with os.pread, then the rest of the index."""
        if not s.shape:  # a scalar: its bytes
            return self._pread(s, 0, s.dtype.itemsize).view(s.dtype).reshape(())
        index = tuple(index) + (slice(None),) * (len(s.shape) - len(index))
        first, last, step = index[0].indices(s.shape[0])
        if step < 1:
            raise ValueError(f"{OPTION} {self.spec}: slices step forward; got {index[0]}")
        last = max(first, last)
        row = math.prod(s.shape[1:]) * s.dtype.itemsize
        raw = self._pread(s, first * row, (last - first) * row)
        t = raw.view(s.dtype).reshape((last - first, *s.shape[1:]))
        t = t[(slice(None, None, step), *index[1:])]
        if t.numel() < raw.numel() // s.dtype.itemsize:  # a part of the rows: its own copy
            t = t.clone(memory_format=torch.contiguous_format)
        return t

    def _pread(self, s: _Stored, start: int, size: int) -> torch.Tensor:
        """`size` bytes at `start` of the tensor data of `s`, as a uint8 tensor."""
        if s.file not in self._fds:
            self._fds[s.file] = os.open(s.file, os.O_RDONLY)
        out = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        while done < size:
            n = os.preadv(self._fds[s.file], [view[done:]], s.offset + start + done)
            if n <= 0:
                raise ckpt.CheckpointError(f"{OPTION} {self.spec}: {s.file} ends early (a "
                                           "truncated safetensors file)")
            done += n
        return out

    def parts(self, wanted: dict[str, tuple[slice, ...] | None]) -> dict[str, torch.Tensor]:
        out = {}
        for name, index in wanted.items():
            s, transposed = self._maps[_known(self, name)]
            full = tuple(slice(None) for _ in s.shape)
            if index is None:
                index = full
            t = self._read(s, tuple(index)[::-1] if transposed else tuple(index))
            out[name] = t.t().contiguous() if transposed else t
        return out

    def load_into(self, module: nn.Module, prefix: str = "") -> None:
        """As SerialSource's, one tensor at a time (a rank holds its own parameters and
        one tensor in flight)."""
        own = module.state_dict()
        with torch.no_grad():
            for k, target in own.items():
                t = self.part(prefix + k)
                if t.shape != target.shape:
                    raise ckpt.CheckpointError(
                        f"{OPTION} {self.spec}: {prefix + k} is {tuple(t.shape)}, this "
                        f"model's {tuple(target.shape)}")
                target.copy_(t)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _known(source: SerialSource, name: str) -> str:
    if name not in source:
        raise KeyError(f"{OPTION} {source.spec} holds no tensor {name!r}")
    return name


def open_source(spec: str, template: nn.Module) -> SerialSource:
    """The source `spec` names, checked against `template` (this run's serial model, on
    the meta device), on this rank alone: CheckpointError naming ``--init-from`` when
    it cannot be read or does not fit."""
    if spec.startswith(HF_PREFIX):
        from .hf import HFConfigError

        try:
            source = _HFSource(spec, spec.removeprefix(HF_PREFIX))
        except (HFConfigError, OSError) as e:
            raise ckpt.CheckpointError(f"{OPTION} {spec}: {e}") from None
        try:
            source.check(template)
        except ckpt.CheckpointError:
            source.close()
            raise
        return source
    # a .pt file is read whole (torch.load has no partial read), checked by name and shape
    return _StateDictSource(spec, ckpt.read_serial_state_dict(spec, template, OPTION))


def read_init(spec: str, make_template: Callable[[], nn.Module],
              group: mcrdl.Group | None = None) -> SerialSource:
    """Collective over `group` (None: the world): the source ``--init-from`` `spec`
    names (a .pt serial state_dict or ``hf:DIR``), opened on every rank and checked
    against ``make_template()`` (this run's serial model, built here on the meta
    device); a problem on any rank raises CheckpointError on all of them."""
    error, source = None, None
    try:
        with torch.device("meta"):
            template = make_template()
        source = open_source(spec, template)
    except ckpt.CheckpointError as e:
        error = e
    raise_together(error, f"cannot read {OPTION} {spec}", group)
    return source

