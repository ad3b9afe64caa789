"""Write ``mcrdl/__init__.pyi``, the type stub of the public API, from the op specs.

The operations (``mcrdl.all_reduce`` ...) are made at import time from
:data:`mcrdl.ops.OPS` (mcrdl/api.py), so type checkers and editors see them only through
this stub: one function per spec (an alias is the same function) with the spec's
parameters, their types and a docstring (the spec's text, each parameter with its units,
and what ``async_op=True`` returns), overloaded so that ``async_op=True`` types as
:class:`mcrdl.Work` and the blocking call as None. The rest of the stub re-exports what
``mcrdl/__init__.py`` imports, read from its source, so the annotated modules behind it
keep their own signatures.

    python -m mcrdl.tools.stubgen          # rewrite mcrdl/__init__.pyi
    python -m mcrdl.tools.stubgen --check  # exit 1 with a diff when it is out of date

Run it after changing an op spec or the imports of mcrdl/__init__.py (tests/test_typing.py
fails until then).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import enum
import pathlib
import re
import sys
import textwrap

from ..ops import ALIASES, OPS, REQUIRED, Kind, OpSpec, Param

PACKAGE = pathlib.Path(__file__).resolve().parent.parent
SOURCE = PACKAGE / "__init__.py"
STUB = PACKAGE / "__init__.pyi"
COMMAND = "python -m mcrdl.tools.stubgen"

_REDUCE_OP = "ReduceOp | torch.distributed.ReduceOp | torch.distributed.ReduceOp.RedOpType"
_BLOCKS = "Tensor | list[Tensor] | tuple[Tensor, ...]"
_COUNTS = "Sequence[int] | Tensor"

#: Kind -> (annotation, what the argument is). Every Kind has an entry: the stub
#: describes each parameter by its kind, as validation reads it (csrc/pyargs.h).
PARAMS: dict[Kind, tuple[str, str]] = {
    Kind.TENSOR: ("Tensor", "a tensor"),
    Kind.BLOCKS: (_BLOCKS, "one tensor of group-size blocks of the per-rank tensor along "
                           "dim 0 (group rank order), or a list of group-size tensors shaped "
                           "like the per-rank tensor"),
    Kind.OPT_BLOCKS: (f"{_BLOCKS} | None", "as for a block argument (one tensor of "
                                           "group-size blocks along dim 0, or a list of "
                                           "group-size tensors) on the root; None elsewhere"),
    Kind.OPT_TENSOR: ("Tensor | None", "a tensor on the root; None elsewhere"),
    Kind.TENSOR_LIST: ("list[Tensor] | tuple[Tensor, ...]",
                       "a list of group-size tensors, entry i for group rank i"),
    Kind.ROOT: ("int", "a group rank"),
    Kind.REDUCE_OP: (_REDUCE_OP, "a mcrdl.ReduceOp or a torch.distributed.ReduceOp"),
    Kind.COUNTS: (_COUNTS, "element counts (not bytes), one per group rank"),
    Kind.DISPLS: (f"{_COUNTS} | None", "element displacements (not bytes), one per group "
                                       "rank; None: packed (the prefix sums of the counts)"),
    Kind.SPLITS: ("Sequence[int] | Tensor | None", "dim-0 rows per group rank; None: equal "
                                                   "splits"),
    Kind.TAG: ("int", "a message tag, 0..32767"),
}

BACKEND = ("str", 'a backend name ("mpi", "gloo", "nccl", "rccl", "cray-mpich", "pccl" or '
                  'a registered one), or "auto" (chosen per call from the tuning table)')
GROUP = ("Group | None", "a Group from mcrdl.new_group; None: the world")
ASYNC = ("False: return None once the result is ready to use on the calling stream or "
         "thread. True: return a Work at once (a bool; 0, 1 and numpy bools are taken as "
         "such)")
RETURNS = ("None once the result is ready; with async_op=True a Work: work.wait(timeout=None) "
           "returns True once the result is ready (CommTimeoutError past the timeout), "
           "work.is_completed() polls, work.backend names the backend that ran it.")
RAISES = (
    ("BackendUnavailableError", "`backend` is unknown, unusable here, or not initialized"),
    ("InvalidArgumentError", "a bad argument (dtype, device, sizes, counts, ranks, group); "
                             "checked before anything is sent"),
    ("UnsupportedOperationError", "the backend lacks this operation (the message names "
                                  "the backends that have it)"),
    ("CommTimeoutError", "a blocking call did not complete within the init timeout (an "
                         "async one's Work.wait raises it)"),
)
VECTORED = ("Tensors are read and written flattened (contiguous); counts and "
            "displacements are in elements of the tensor's dtype.")


def _default(param: Param) -> str:
    """The default of `param` as stub source (an enum member by its class and name)."""
    value = param.default
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    text = repr(value)
    ast.literal_eval(text)  # a stub default must be plain source
    return text


def _kind(param: Param) -> tuple[str, str]:
    try:
        return PARAMS[param.kind]
    except KeyError:
        raise SystemExit(f"stubgen: parameter {param.name!r} is of kind {param.kind}, which "
                         "has no stub type; add it to PARAMS in mcrdl/tools/stubgen.py") from None


def docstring(spec: OpSpec) -> str:
    """The docstring of operation `spec`: the spec's text, every parameter, what the
    call returns and raises."""
    lines = [spec.doc]
    if any(p.kind is Kind.COUNTS for p in spec.params):
        lines += ["", VECTORED]
    lines += ["", "Args:", f"    backend: {BACKEND[1]}."]
    for p in spec.params:
        lines.append(f"    {p.name}: {_kind(p)[1]}.")
    lines += [f"    group: {GROUP[1]}.", f"    async_op: {ASYNC}.", "", "Returns:",
              f"    {RETURNS}", "", "Raises:", *(f"    {e}: {why}." for e, why in RAISES)]
    return "\n".join(lines)


_ITEM = re.compile(r"    \w+: ")  # "    name: text", an entry of Args


def _wrap(text: str, indent: str, width: int = 96) -> list[str]:
    """`text`'s lines wrapped at `width` (continuation lines indented under their item)."""
    out = []
    for line in text.split("\n"):
        body = line.lstrip()
        lead = indent + line[:len(line) - len(body)]
        more = lead + ("    " if _ITEM.match(line) else "")
        out += textwrap.wrap(body, width, initial_indent=lead, subsequent_indent=more,
                             break_on_hyphens=False) or [""]
    return out


def operation(name: str, spec: OpSpec) -> str:
    """The overloads of operation `name`: blocking (None), ``async_op=True`` (Work), and
    an ``async_op`` known only as a bool. The first one holds the docstring, which pyright
    shows for all three."""
    params = [f"backend: {BACKEND[0]}"]
    for p in spec.params:
        annotation = _kind(p)[0]
        params.append(f"{p.name}: {annotation}" if p.default is REQUIRED
                      else f"{p.name}: {annotation} = {_default(p)}")
    params.append(f"group: {GROUP[0]} = None")
    doc = ['    """' + line[4:] if i == 0 else line
           for i, line in enumerate(_wrap(docstring(spec), "    "))]
    doc[-1] += '"""'
    out = []
    for last, result in (("async_op: Literal[False] = False", "None"),
                         ("*, async_op: Literal[True]", "Work"),
                         ("async_op: bool = False", "Work | None")):
        out += ["@overload", f"def {name}("]
        out += [f"    {p}," for p in (*params, *last.split(", "))]
        out += [f") -> {result}:", *doc, ""] if result == "None" else [f") -> {result}: ...", ""]
    return "\n".join(out)


def _isort_key(item: str) -> tuple[int, str]:
    """Ruff's (isort's) order of names imported from one module: constants, classes,
    then the rest, each alphabetically."""
    name = item.split(" as ")[0]
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower()


def _reexports(tree: ast.Module) -> tuple[list[str], list[str]]:
    """The public names mcrdl/__init__.py imports, as stub import lines (``x as x``, so
    that checkers take them as re-exported), and its other module-level names."""
    imports: dict[str, list[str]] = {}
    other = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for a in node.names:
                public = a.asname or a.name
                if not public.startswith("_"):
                    imports.setdefault(module, []).append(f"{a.name} as {public}")
        elif isinstance(node, ast.Assign):
            other += [t.id for t in node.targets if isinstance(t, ast.Name)]
    modules = sorted(imports, key=lambda m: (m != ".", m))
    lines = [f"from {m} import {name}"
             for m in modules for name in sorted(imports[m], key=_isort_key)]
    return lines, other


def render() -> str:
    """The text of mcrdl/__init__.pyi."""
    import mcrdl

    tree = ast.parse(SOURCE.read_text(), str(SOURCE))
    imports, assigned = _reexports(tree)
    unknown = [n for n in assigned if n not in ("__version__", "__all__")]
    if unknown:
        raise SystemExit(f"stubgen: mcrdl/__init__.py assigns {unknown}, which the stub "
                         "cannot type; import them from the module that defines them")
    module_doc = ast.get_docstring(tree, clean=False) or ""
    out = [
        f'"""{module_doc}"""',
        "",
        f"# Generated by `{COMMAND}` from mcrdl/ops.py and mcrdl/__init__.py.",
        "",
        "from collections.abc import Sequence",
        "from typing import Literal, overload",
        "",
        "import torch",
        "from torch import Tensor",
        "",
        *imports,
        "",
        "__version__: str",
        "",
        "__all__ = [",
        *(f'    "{n}",' for n in mcrdl.__all__),
        "]",
        "",
    ]
    for name, spec in OPS.items():
        out += ["", operation(name, spec)]
    out += ["", *(f"{alias} = {name}" for alias, name in ALIASES.items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff when the stub is out of date")
    args = parser.parse_args(argv)
    text = render()
    current = STUB.read_text() if STUB.exists() else ""
    if args.check:
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                    f"{STUB.name} (in the tree)", f"{STUB.name} (from the specs)")
        sys.stdout.writelines(diff)
        print(f"\n{STUB} is out of date with mcrdl/ops.py or mcrdl/__init__.py; run `{COMMAND}`",
              file=sys.stderr)
        return 1
    if current != text:
        STUB.write_text(text)
        print(f"wrote {STUB}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
