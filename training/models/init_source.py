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

import os
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

import mcrdl

from ..core import checkpoint as ckpt
from ..core.runtime import raise_together
from ..core.run_options import HF_PREFIX

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


class _HFSource(SerialSource):
    """A Hugging Face directory, read tensor by tensor through safetensors slices."""

    def __init__(self, spec: str, directory: str):
        from .hf import HFCheckpoint

        self.spec = spec
        self._ckpt = HFCheckpoint(directory)
        self.config = self._ckpt.config
        shapes: dict[str, tuple[int, ...]] = {}

        def record(name: str, shape: tuple[int, ...]) -> None:
            shapes[name] = tuple(shape)
            return None

        self._ckpt.state_dict(record)  # every name and shape; reads no tensor
        self._shapes = shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[_known(self, name)]

    def parts(self, wanted: dict[str, tuple[slice, ...] | None]) -> dict[str, torch.Tensor]:
        for name in wanted:
            _known(self, name)

        def select(name: str, shape: tuple[int, ...]):
            if name not in wanted:
                return None
            index = wanted[name]
            return tuple(slice(None) for _ in shape) if index is None else tuple(index)

        return self._ckpt.state_dict(select)

    def close(self) -> None:
        self._ckpt.close()


def _known(source: SerialSource, name: str) -> str:
    if name not in source:
        raise KeyError(f"{OPTION} {source.spec} holds no tensor {name!r}")
    return name


def open_source(spec: str) -> SerialSource:
    """The source `spec` names, unchecked (this rank alone): CheckpointError naming
    ``--init-from`` when it cannot be read."""
    if spec.startswith(HF_PREFIX):
        from .hf import HFConfigError

        directory = spec.removeprefix(HF_PREFIX)
        try:
            return _HFSource(spec, directory)
        except (HFConfigError, OSError) as e:
            raise ckpt.CheckpointError(f"{OPTION} {spec}: {e}") from None
    path = os.fspath(spec)
    try:
        state = ckpt.load_file(path, path, OPTION)
    except ckpt.CheckpointError:
        raise
    except FileNotFoundError:
        raise ckpt.CheckpointError(f"{OPTION} {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - torch's errors of a file of another kind
        raise ckpt.CheckpointError(f"{OPTION} {path}: not a state_dict torch can load "
                                   f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        held = (f"a dict of {', '.join(map(repr, list(state)[:4]))}"
                if isinstance(state, dict) else f"a {type(state).__name__}")
        raise ckpt.CheckpointError(
            f"{OPTION} {path} is not a state_dict (names to tensors) but {held} (a "
            "checkpoint's shard?); python -m training.checkpoint consolidate writes a "
            "checkpoint's state_dict")
    return _StateDictSource(spec, state)


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
        source = open_source(spec)
        source.check(template)
    except ckpt.CheckpointError as e:
        error = e
        if source is not None:
            source.close()
    raise_together(error, f"cannot read {OPTION} {spec}", group)
    return source

