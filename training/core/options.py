"""Training options: config sections as dataclasses, their validation, the command line
built from them, and ``--config FILE`` (TOML or JSON).

A run's config is one flat dataclass composed of sections (the shared ``ModelOptions``,
``DataOptions``, ``OptimizerOptions``, ``RunOptions`` of training/core/run_options.py,
and each engine's own, such as ``PipelineOptions``), so every
option is one attribute (``cfg.G_inter``) and one flag. Each field is declared with
``option()``: the field name is the option (``G_inter`` is ``--G-inter`` on the command
line and ``G_inter`` or ``G-inter`` in a config file) and its metadata holds the help
text, the allowed values and, for a grid degree, the ``Axis`` it sets. An engine adds
options by adding a section and composing its own config class; ``parse_args`` builds
the command line of any such class, one argument group per section.

Values come from the field defaults, then ``--config FILE`` (option names as keys, at
the top level or in a table named after their section: ``[parallel]``), then the
command line; ``validate()`` then checks types, ranges and the rules between options
and with the model's shape, ``check_world`` those with the world's size and
``validate_node`` what this node must provide (paths, backends): together, before
anything is built, every rule an engine enforces (training/core/validate.py says how a
refusal is reported).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import Field, field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, ClassVar, TypeVar

from mcrdl.launch import detect as detect_launch
from mcrdl.launch import launch_command

from .topology import Axis, GridError

_TENSOR_AXES = (Axis.X, Axis.Y, Axis.Z)


def option(default: Any, help: str, *, minimum: float | None = None,
           above: float | None = None, choices: Sequence[str] | None = None,
           axis: Axis | None = None, const: Any = None,
           parse: Callable[[str], Any] | None = None) -> Any:
    """A config field. ``validate()`` checks `minimum` (the least value), `above` (a
    bound the value must exceed) and `choices`, and that a float is finite; `axis`
    marks a grid degree; `const` is the value of the flag given without a value;
    `parse` turns a string value, from any source, into the option's own spelling
    (ValueError for a bad one) before the checks."""
    metadata = {"help": help, "minimum": minimum, "above": above, "choices": choices,
                "axis": axis, "const": const, "parse": parse}
    return field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line flag of option `name`: ``G_inter`` -> ``--G-inter``."""
    return "--" + name.replace("_", "-")


class Options:
    """Base of the config sections. A section class sets ``section`` (its name in
    ``--help`` and in config files) and may define ``check(self)`` for the rules between
    its options and ``check_model(self, model)`` for those between its options and the
    model's shape (``model_config()``); ``validate()`` checks every field, then runs
    each section's ``check``, then its ``check_model``. ``check_world(world_size)``
    holds the rules of the world's size, ``check_node(self)`` (``validate_node()``)
    what this node must provide (files, backends). Together they state every rule an engine enforces
    before anything is built (``parse_args`` with `world_size`), so that an engine's
    own checks are guards a user's options never reach.
    The grid is read from the options declared with an ``axis``, whatever their section."""

    section: ClassVar[str]

    def validate(self) -> None:
        """Raise ValueError naming the option (``--flag``) that is wrong and why."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            parse, value = f.metadata.get("parse"), getattr(self, f.name)
            if parse is not None and isinstance(value, str):
                try:
                    setattr(self, f.name, parse(value))
                except ValueError as e:  # it names the value
                    raise ValueError(f"{flag(f.name)} {e}") from None
            _check_value(f, getattr(self, f.name), hints[f.name])
        for section in sections(type(self)):
            if "check" in vars(section):
                section.check(self)
        model = self.model_config()
        if model is not None:
            for section in sections(type(self)):
                if "check_model" in vars(section):
                    section.check_model(self, model)

    def model_config(self) -> Any:
        """The model shape the options give (the command's config class resolves it:
        ValueError naming the model options), for the sections' ``check_model(self,
        model)`` rules; None: no model to check."""
        return None

    def validate_node(self) -> None:
        """Run each section's ``check_node``: the paths this process cannot use, the
        backends it cannot start (PathOptionError). Kept apart from validate():
        another node may see other files or have other hardware, so these are the
        errors only some ranks of a launch may have."""
        for section in sections(type(self)):
            if "check_node" in vars(section):
                section.check_node(self)

    def degrees(self) -> dict[Axis, int]:
        """The degree of each grid axis, from the options that declare an axis."""
        return {f.metadata["axis"]: getattr(self, f.name) for f in self._degree_fields()}

    def degree_options(self) -> dict[str, int]:
        """The grid as option name -> degree (``{"G_inter": 2, "G_data": 2}``)."""
        return {f.name: getattr(self, f.name) for f in self._degree_fields()}

    def describe_grid(self) -> str:
        """The grid as options: ``G_inter=2 x G_data=2``; the 4D tensor axes (x, y, z)
        only when one of them has degree > 1."""
        opts = self.degree_options()
        tensor = {f.name for f in self._degree_fields() if f.metadata["axis"] in _TENSOR_AXES}
        if all(opts[name] == 1 for name in tensor):
            opts = {k: v for k, v in opts.items() if k not in tensor}
        return " x ".join(f"{name}={n}" for name, n in opts.items())

    def check_world(self, world_size: int) -> None:
        """Raise GridError unless the grid's degrees multiply to `world_size`, naming the
        options, the launch that fits them and the --G-data that fits the world."""
        opts = self.degree_options()
        total = math.prod(opts.values())
        if total == world_size or min(opts.values(), default=1) < 1:
            return  # a bad degree: validate() and ProcessGrid name it
        fits = ""
        rest = total // opts.get("G_data", 1)
        data = world_size // rest
        # --G-data that fills the world, where the global batch also splits over it
        if ("G_data" in opts and world_size % rest == 0
                and getattr(self, "global_batch_size", 0)
                % (data * getattr(self, "micro_batch_size", 1)) == 0):
            others = " and ".join(f"{flag(n)} {v}" for n, v in opts.items()
                                  if n != "G_data" and v > 1)
            fits = (f" (with {others}: " if others else " (") + f"--G-data {data})"
        raise GridError(f"process grid {self.describe_grid()} needs {total} ranks but the "
                        f"world has {world_size}; launch with {launch_command(total)} or "
                        f"change the degrees so that their product is {world_size}{fits}")

    def _degree_fields(self) -> list[Field]:
        return [f for f in fields(self) if f.metadata.get("axis") is not None]


def sections(config_class: type) -> list[type]:
    """The sections `config_class` is composed of, in the order of their fields."""
    return [c for c in reversed(config_class.__mro__) if "section" in vars(c)]


def _section_fields(section: type) -> list[str]:
    """The options `section` itself declares (not those of its bases)."""
    return list(inspect.get_annotations(section))


# -- paths ------------------------------------------------------------------------------

class PathOptionError(ValueError):
    """An option names a path or a backend this process cannot use, or a value read
    from a --config file is refused. Unlike the other option errors, which follow from
    the command line alone and so are the same on every rank, this one is of this node:
    another node may see other files (or another copy of the file)."""


def _existing_ancestor(path: Path) -> Path:
    """`path` itself, else its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_directory(option: str, given: str | Path) -> None:
    """PathOptionError naming `option` when directory `given` cannot be made or written: it or
    an ancestor is a file, or the nearest existing ancestor is not writable (a run would
    train and then fail at its first save)."""
    path = Path(given)
    found = _existing_ancestor(path)
    if not found.is_dir():
        what = "is a file" if found == path.absolute() else f"is inside the file {found}"
        raise PathOptionError(f"{option} {given} {what}; expected a directory (made if "
                              "missing)")
    if not os.access(found, os.W_OK | os.X_OK):
        raise PathOptionError(f"{option} {given}: {found} is not writable by this user")


def check_file(option: str, given: str | Path) -> None:
    """PathOptionError naming `option` when file `given` cannot be written: it is a directory,
    or its directory cannot be made (``check_directory``)."""
    path = Path(given)
    if path.is_dir():
        raise PathOptionError(f"{option}: {given} is a directory; expected a file")
    check_directory(option, path.parent)


# -- types of values --------------------------------------------------------------------

def _value_types(hint: Any) -> tuple[type, ...]:
    """The types a field annotated `hint` holds (``int | None`` -> (int, NoneType))."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _scalar_type(hint: Any) -> type:
    return next(t for t in _value_types(hint) if t is not NoneType)


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_value(f: Field, value: Any, hint: Any) -> None:
    types = _value_types(hint)
    if value is None:
        if NoneType not in types:
            raise ValueError(f"{flag(f.name)} has no value; expected {_EXPECTED[types[0]]}")
        return
    kind = _scalar_type(hint)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{flag(f.name)} is {value!r}; expected {_EXPECTED[kind]}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{flag(f.name)} is {value!r}; expected a finite number")
    above = f.metadata.get("above")
    if above is not None and not value > above:
        raise ValueError(f"{flag(f.name)} is {value!r}; expected > {above}")
    choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
    if choices is not None and value not in choices:
        raise ValueError(f"{flag(f.name)} {value!r}: expected one of {', '.join(choices)}")
    if minimum is not None and value < minimum:
        wanted = "a positive integer" if (kind is int and minimum == 1) else f">= {minimum}"
        raise ValueError(f"{flag(f.name)} is {value!r}; expected {wanted}")


# -- command line and config files ------------------------------------------------------

ConfigT = TypeVar("ConfigT", bound=Options)


class UsageError(ValueError):
    """argparse's complaint about the command line (an unknown flag, a value of the wrong
    type): ``str()`` is its "prog: error: ..." line, ``usage`` the usage lines it prints
    before it."""

    def __init__(self, usage: str, message: str):
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """Raises UsageError where argparse would print and exit: the caller decides which
    rank prints it (run_command: one, since every rank has the same command line)."""

    def error(self, message: str):
        raise UsageError(self.format_usage(), f"{self.prog}: error: {message}")

    def print_help(self, file=None):
        if detect_launch().rank == 0:  # --help: the same text on every rank of a launch
            super().print_help(file)


def parse_args(config_class: type[ConfigT], argv: Sequence[str] | None = None, *,
               prog: str | None = None, description: str | None = None,
               world_size: int | None = None) -> ConfigT:
    """A validated `config_class` from the defaults, ``--config FILE`` and `argv` (in
    that order of precedence, the last winning); with `world_size`, also checked
    against a world of that many ranks (``check_world``). Every rule of the command
    line and the world is checked before this node's paths and backends
    (``validate_node``), so that every rank of a launch refuses the same command line
    alike, and only the node's errors may differ between them. Raises ValueError
    naming a bad option (UsageError where argparse refuses the command line,
    PathOptionError for a path or backend this node cannot use or a value of a
    --config file), FileNotFoundError for a missing config file."""
    parser = _Parser(prog=prog, description=description,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML or JSON file of options (see above)")
    defaults = config_class()
    hints = typing.get_type_hints(config_class)
    by_name = {f.name: f for f in fields(config_class)}
    for section in sections(config_class):
        group = parser.add_argument_group(f"{section.section} options")
        for name in _section_fields(section):
            _add_flag(group, by_name[name], hints[name], getattr(defaults, name))
    args = parser.parse_args(argv)
    try:
        values = read_config_file(args.config, config_class) if args.config else {}
        values.update({name: getattr(args, name) for name in by_name
                       if getattr(args, name) is not None})
        config = config_class(**values)
        config.validate()
        if world_size is not None:
            config.check_world(world_size)
        config.validate_node()
    except PathOptionError:
        raise
    except ValueError as e:
        if not args.config:
            raise
        # its values came (or may have come) from this node's copy of the file
        raise PathOptionError(str(e)) from e
    return config


def _add_flag(group, f: Field, hint: Any, default: Any) -> None:
    choices = f.metadata.get("choices")
    help_text = f.metadata["help"] + (f": {', '.join(choices)}" if choices else "")
    if default is not None:
        help_text += f" (default {default})"
    kind = _scalar_type(hint)
    if f.metadata.get("const") is not None:
        group.add_argument(flag(f.name), nargs="?", const=f.metadata["const"], default=None,
                           type=kind, help=help_text)
    elif kind is bool:
        group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
    else:
        group.add_argument(flag(f.name), type=kind, default=None, help=help_text)


def read_config_file(path: str, config_class: type[Options]) -> dict[str, Any]:
    """Option values from a TOML (``.toml``) or JSON file: option names (with ``_`` or
    ``-``) as keys, at the top level or in a table named after their section."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        if file.suffix == ".toml":
            try:
                import tomllib
            except ImportError as e:  # Python 3.10
                raise ValueError("TOML needs Python >= 3.11; use JSON") from e
            raw = tomllib.loads(file.read_text())
        else:
            raw = json.loads(file.read_text())
    except ValueError as e:  # including the TOML and JSON decoders' errors
        raise ValueError(f"--config {path}: {e}") from e
    except OSError as e:  # a directory, no permission
        raise PathOptionError(f"--config {path}: {e.strerror or e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a table of options, got "
                         f"{type(raw).__name__}")
    known = {f.name for f in fields(config_class)}
    section_fields = {s.section: _section_fields(s) for s in sections(config_class)}
    values = {}
    for key, value in raw.items():
        if key in section_fields and isinstance(value, dict):
            entries = [(key, k, v) for k, v in value.items()]
        else:
            entries = [(None, key, value)]
        for table, option_key, option_value in entries:
            name = option_key.replace("-", "_")
            if name not in known:
                raise ValueError(f"--config {path}: unknown option {option_key!r}")
            if table is not None and name not in section_fields[table]:
                home = next(t for t, names in section_fields.items() if name in names)
                raise ValueError(f"--config {path}: option {option_key!r} is in [{table}]; "
                                 f"it belongs in [{home}] (or at the top level)")
            values[name] = option_value
    return values
