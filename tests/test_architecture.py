"""The layering rules of docs/architecture.md, checked on the source (ast), not by running it.

- No import cycle among the modules of mcrdl/, nor among those of training/ (every
  import counts, module level or inside a function, but those under ``if
  TYPE_CHECKING:``; importing a module imports its parent packages too).
- training/ is layered: core/ (shared by every engine), then models/ (the serial
  models), then the libraries of parallel parts (tensor_parallel/, samo/), then the
  engines (pipeline/, parallel4d/, ted/), then the planner over the engines' models
  (plan/), then the commands (train_gpt, train_moe,
  checkpoint, ...). A module imports only from the layers below its own and from its
  own package: no engine imports another, nothing shared imports an engine.
- The front (``mcrdl`` and ``mcrdl.api``) is imported only by ``mcrdl/__init__.py`` and
  the programs in ``mcrdl/tools/``; nothing else under mcrdl/ imports those programs.
- An operation name is declared as a table only in mcrdl/ops.py: no other source file
  (Python or C++) holds a per-operation mapping (three or more operations) or a list of
  five or more operation names; tests, whose expected values name the operations they
  check, may not hold a list of twelve or more (a second list of the operations).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from mcrdl.ops import OPS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "mcrdl"
TRAINING = ROOT / "training"
FRONT = {"mcrdl", "mcrdl.api"}
TOOLS = "mcrdl.tools"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(pkg: pathlib.Path = PKG) -> dict[str, pathlib.Path]:
    mods = {_module_name(p): p for p in pkg.rglob("*.py")}
    for ext in pkg.rglob("*.so"):  # compiled modules (mcrdl._C): leaves of the graph
        mods[_module_name(ext.with_name(ext.name.split(".")[0] + ".py"))] = ext
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of `name`'s top-level package (mcrdl, training) that `name` imports
    (resolved against the modules that exist)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    found: set[str] = set()

    def ours(module: str) -> bool:
        return module == top or module.startswith(top + ".")

    def add(target: str) -> None:
        # "from pkg import x" imports pkg.x when that is a module, else pkg; the parent
        # packages below the root are imported on the way, but for the importer's own
        # packages, which are being imported already.
        if target not in known:
            return
        found.add(target)
        parts = target.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if name != parent and not name.startswith(parent + "."):
                found.add(parent)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if ours(mod):
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    add(sub if sub in known else mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def _graph(pkg: pathlib.Path = PKG) -> dict[str, set[str]]:
    mods = _modules(pkg)
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()
            if path.suffix == ".py"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    graph = _graph()
    # The root package imports everything it re-exports; a module importing the root is
    # the front rule's business (below), so the root's own edges are left out here.
    graph = {m: {t for t in ts if t != "mcrdl"} for m, ts in graph.items() if m != "mcrdl"}
    cycles = _cycles(graph)
    assert not cycles, "import cycles in mcrdl/:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_only_the_tools_import_the_front():
    bad = []
    for name, targets in _graph().items():
        if name == "mcrdl" or name == TOOLS or name.startswith(TOOLS + "."):
            continue
        for t in sorted(targets):
            if t in FRONT or t == TOOLS or t.startswith(TOOLS + "."):
                bad.append(f"{name} imports {t}")
    assert not bad, "modules below the front reach up:\n" + "\n".join(bad)


def test_checker_sees_cycles_and_reach_ups(tmp_path):
    """The checks above fail on what they must catch (a checker that finds nothing
    proves nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    pkg = tmp_path / "mcrdl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import api\n"
        "if TYPE_CHECKING:\n    from . import hidden\n"
        "def f():\n    import mcrdl.sub.other\n")
    known = {"mcrdl", "mcrdl.api", "mcrdl.sub", "mcrdl.sub.low", "mcrdl.sub.hidden",
             "mcrdl.sub.other"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _imports("mcrdl.sub.low", pkg / "sub" / "low.py", known)
    finally:
        ROOT = saved
    assert found == {"mcrdl.api", "mcrdl.sub.other"}  # its own package is not an edge


# -- training/: one package per engine, in layers -------------------------------------------

#: The layers of training/, lowest first: a module may import from a lower layer and from
#: its own package, nothing else. The last layer is the commands (the modules directly
#: under training/), which nothing imports.
TRAINING_LAYERS = (
    ("training.core",),
    ("training.models",),
    ("training.tensor_parallel", "training.samo"),
    ("training.pipeline", "training.parallel4d", "training.ted"),
    ("training.plan",),
)


def _training_package(module: str) -> str:
    """The package of training/ that `module` belongs to (``training.ted.zero`` ->
    ``training.ted``); a command directly under training/ is its own."""
    return ".".join(module.split(".")[:2])


def _training_layer(module: str) -> int:
    package = _training_package(module)
    for i, layer in enumerate(TRAINING_LAYERS):
        if package in layer:
            return i
    return len(TRAINING_LAYERS)  # a command (training.train_gpt, ...) or the root


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of training/ that reach sideways (another package of the same layer: an
    engine importing another engine) or up (a shared module importing an engine, or
    anything importing a command)."""
    bad = []
    for name, targets in sorted(graph.items()):
        for t in sorted(targets):
            if t == "training" or _training_package(t) == _training_package(name):
                continue
            if _training_layer(t) >= _training_layer(name):
                bad.append(f"{name} imports {t}")
    return bad


def test_no_import_cycles_in_training():
    cycles = _cycles(_graph(TRAINING))
    assert not cycles, ("import cycles in training/:\n"
                        + "\n".join(" <-> ".join(c) for c in cycles))


def test_training_packages_are_layered():
    graph = _graph(TRAINING)
    unplaced = sorted({_training_package(m) for m in graph
                       if m.count(".") >= 2 and _training_layer(m) == len(TRAINING_LAYERS)})
    assert not unplaced, (f"packages of training/ in no layer: {unplaced}; add each to "
                          "TRAINING_LAYERS")
    bad = layer_violations(graph)
    assert not bad, ("imports against training/'s layers (core < models < tensor_parallel, "
                     "samo < engines < commands; shared code goes down to core/ or "
                     "models/):\n" + "\n".join(bad))


def test_layer_checker_sees_violations():
    graph = {"training.ted.trainer": {"training.pipeline.trainer", "training.core.runtime",
                                      "training.ted.model"},
             "training.core.checkpoint": {"training.ted.trainer"},
             "training.models.moe": {"training.models.gpt", "training.core.sharding"},
             "training.samo.pruning": {"training.tensor_parallel.layers"},
             "training.pipeline.trainer": {"training.train_gpt"}}
    assert layer_violations(graph) == [
        "training.core.checkpoint imports training.ted.trainer",
        "training.pipeline.trainer imports training.train_gpt",
        "training.samo.pruning imports training.tensor_parallel.layers",
        "training.ted.trainer imports training.pipeline.trainer"]


# -- operation names are declared once ---------------------------------------------------

NAMES = set(OPS)
_SOURCES = ("mcrdl", "training", "benchmarks", "examples", "tests")


def _op_names(nodes) -> list[str]:
    return [n.value for n in nodes
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES]


def op_tables(tree: ast.AST, *, in_tests: bool = False) -> list[tuple[int, list[str]]]:
    """Literal tables of operation names: a dict keyed by three or more of them, or a
    list/tuple/set of five or more (a choice of a few ops to benchmark is not a
    declaration of what the operations are); in tests, twelve or more of either."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            names, least = _op_names(k for k in node.keys if k is not None), 3
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            names, least = _op_names(node.elts), 5
        else:
            continue
        if len(set(names)) >= (12 if in_tests else least):
            found.append((node.lineno, names))
    return found


_CPP_STRING_LIST = re.compile(r"\{[^{};]*\}", re.S)


def cpp_op_tables(text: str) -> list[list[str]]:
    """Brace initializers holding three or more quoted operation names."""
    out = []
    for m in _CPP_STRING_LIST.finditer(text):
        names = [n for n in re.findall(r'"(\w+)"', m.group(0)) if n in NAMES]
        if len(set(names)) >= 3:
            out.append(names)
    return out


def test_operation_names_are_declared_only_in_ops():
    bad = []
    for top in _SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == PKG / "ops.py" or "build" in path.relative_to(ROOT).parts:
                continue
            tree = ast.parse(path.read_text(), str(path))
            for line, names in op_tables(tree, in_tests=top == "tests"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {sorted(set(names))}")
    for path in sorted((PKG / "csrc").glob("*.[ch]*")):
        for names in cpp_op_tables(path.read_text()):
            bad.append(f"{path.relative_to(ROOT)}: {sorted(set(names))}")
    assert not bad, ("operation names declared as a table outside mcrdl/ops.py (derive "
                     "them from mcrdl.ops.OPS):\n" + "\n".join(bad))


@pytest.mark.parametrize("source, tables", [
    ('X = {"all_reduce": 1, "bcast": 2, "gather": 3}', 1),
    ('X = {"all_reduce": 1, "bcast": 2}', 0),
    ('X = ("all_reduce", "reduce", "bcast", "all_gather", "gather")', 1),
    ('X = ("all_reduce", "bcast")', 0),
    ('if op == "all_reduce" or op == "bcast": pass', 0),
])
def test_table_checker(source, tables):
    assert len(op_tables(ast.parse(source))) == tables


def test_cpp_table_checker():
    assert cpp_op_tables('const char* k[] = {"all_reduce", "bcast", "gather"};')
    assert not cpp_op_tables('if (o == "all_reduce") { f(); } else if (o == "bcast") { g(); }')
