"""Type information of the public API: mcrdl/__init__.pyi, made from the op specs by
mcrdl/tools/stubgen.py, and mcrdl/py.typed.

- The stub is what the generator makes of mcrdl/ops.py and mcrdl/__init__.py now, and
  agrees with the runtime: each operation's parameters (names, kinds, defaults) are the
  runtime function's, every re-export names the object mcrdl exports.
- pyright and mypy accept tests/typing/user_program.py (the documented API) and
  training_program.py (the training package's entry points), and report exactly the
  lines marked ``# mistake`` in mistakes.py, from the source tree and from a wheel
  installed in a fresh venv (tests/_wheel.py); pyright's hover shows an operation's
  docstring. The two user programs also run.

The checkers take most of this module's time: mypy's first run analyzes torch (about
half a minute here; its cache under pytest's cache folder makes later runs seconds).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tokenize

import pytest

import mcrdl
from mcrdl.ops import ALIASES, OPS, Kind, Param
from mcrdl.tools import stubgen

from ._launch import clean_env, mpiexec_or_skip, run_launcher, skip_without
from ._wheel import TEST_TIMEOUT_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAMS = pathlib.Path(__file__).resolve().parent / "typing"
MISTAKE = "# mistake"
TRAINING_PROGRAM = "training_program.py"
CHECK_TIMEOUT_S = 600


# -- the stub agrees with the specs and the runtime --------------------------------------

def test_stub_is_generated_from_the_specs(capsys):
    stale = stubgen.main(["--check"])
    assert stale == 0, (f"mcrdl/__init__.pyi is out of date; run `{stubgen.COMMAND}`:\n"
                        f"{capsys.readouterr().out[-6000:]}")


def test_a_new_parameter_or_operation_makes_the_stub_stale(monkeypatch):
    """The check above fails on what it must catch: a spec that grew a parameter, and
    a new operation."""
    spec = OPS["all_reduce"]
    grown = dataclasses.replace(spec, params=(*spec.params, Param("extra", Kind.TAG, 0)))
    new = dataclasses.replace(spec, name="all_reduce_new")
    monkeypatch.setattr(stubgen, "OPS", {**OPS, "all_reduce": grown, new.name: new})
    text = stubgen.render()
    assert text != stubgen.STUB.read_text()
    assert "    extra: int = 0," in text and "def all_reduce_new(" in text


def _stub() -> ast.Module:
    return ast.parse(stubgen.STUB.read_text(), str(stubgen.STUB))


def _overloads() -> dict[str, list[ast.FunctionDef]]:
    found: dict[str, list[ast.FunctionDef]] = {}
    for node in _stub().body:
        if isinstance(node, ast.FunctionDef):
            found.setdefault(node.name, []).append(node)
    return found


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    """The stub function's parameters (names, kinds, defaults; no annotations)."""
    namespace = {"ReduceOp": mcrdl.ReduceOp}
    a = fn.args

    def params(args, kind, defaults):
        # (kw_defaults holds None for a keyword-only parameter without a default)
        defaults = [None] * (len(args) - len(defaults)) + list(defaults)
        defaults = [inspect.Parameter.empty if d is None
                    else eval(ast.unparse(d), namespace) for d in defaults]  # noqa: S307
        return [inspect.Parameter(p.arg, kind, default=d)
                for p, d in zip(args, defaults, strict=True)]

    return inspect.Signature([
        *params(a.args, inspect.Parameter.POSITIONAL_OR_KEYWORD, a.defaults),
        *params(a.kwonlyargs, inspect.Parameter.KEYWORD_ONLY, a.kw_defaults)])


def _plain(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                   for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)


@pytest.mark.parametrize("name", OPS)
def test_stub_operation_is_the_runtime_function(name):
    """Overloads: blocking (async_op=False) and bool async_op have the runtime function's
    exact parameters; the async_op=True one differs only in async_op being keyword-only
    and required. The first one carries the docstring, with every parameter."""
    runtime = _plain(inspect.signature(getattr(mcrdl, name)))
    overloads = _overloads().get(name)
    assert overloads and len(overloads) == 3, f"mcrdl/__init__.pyi lacks {name}'s overloads"
    blocking, waitable, either = (_signature(f) for f in overloads)
    assert blocking == runtime and either == runtime, (name, blocking, either, runtime)
    wanted = [*list(runtime.parameters.values())[:-1],
              inspect.Parameter("async_op", inspect.Parameter.KEYWORD_ONLY)]
    assert list(waitable.parameters.values()) == wanted, (name, waitable)
    returns = [ast.unparse(f.returns) for f in overloads]
    assert returns == ["None", "Work", "Work | None"], (name, returns)
    spec = OPS[name]
    doc = ast.get_docstring(overloads[0]) or ""  # pyright shows it for all three
    assert " ".join(spec.doc.split()) in " ".join(doc.split()), (name, doc)
    for param in runtime.parameters:
        assert re.search(rf"^    {param}: ", doc, re.M), (name, param, doc)


def test_stub_has_no_function_the_runtime_lacks():
    extra = set(_overloads()) - set(OPS)
    assert not extra, f"mcrdl/__init__.pyi defines {sorted(extra)}, which mcrdl has not"


def test_stub_aliases_are_the_runtime_aliases():
    """An alias is the same function at run time (mcrdl.broadcast is mcrdl.bcast), and
    in the stub an assignment of it."""
    assigned = {ast.unparse(n.targets[0]): ast.unparse(n.value) for n in _stub().body
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)}
    assert assigned == ALIASES
    for alias, name in ALIASES.items():
        assert getattr(mcrdl, alias) is getattr(mcrdl, name)


def test_stub_reexports_what_mcrdl_exports():
    """Every import of the stub names the very object mcrdl has under that name; every
    public non-module attribute of mcrdl is in the stub; __all__ is the runtime's."""
    declared = set(_overloads())
    stub_all = None
    for node in _stub().body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            module = importlib.import_module("mcrdl" + (f".{node.module}" if node.module else ""))
            for a in node.names:
                assert a.asname, f"stub import of {a.name} lacks `as` (not re-exported)"
                got = getattr(module, a.name) if hasattr(module, a.name) else \
                    importlib.import_module(f"{module.__name__}.{a.name}")
                assert getattr(mcrdl, a.asname) is got, (a.name, a.asname, module.__name__)
                declared.add(a.asname)
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            stub_all = ast.literal_eval(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            declared.add(ast.unparse(getattr(node, "target", None) or node.targets[0]))
    assert stub_all == list(mcrdl.__all__)
    public = {n for n, v in vars(mcrdl).items()
              if (not n.startswith("_") or n == "__version__") and not inspect.ismodule(v)}
    assert public - declared == set(), "in mcrdl but not in its stub"
    assert set(stub_all) <= declared


# -- the checkers on user programs ---------------------------------------------------------

def _programs(tmp_path: pathlib.Path) -> pathlib.Path:
    """The programs copied out of the checkout: nothing beside them resolves `mcrdl`."""
    where = tmp_path / "programs"
    where.mkdir()
    for p in PROGRAMS.glob("*.py"):
        shutil.copy(p, where / p.name)
    return where


def _planted() -> dict[str, set[int]]:
    """The lines each program must get errors on: those with a comment starting with
    MISTAKE (in mistakes.py; the other programs have none)."""
    planted = {}
    for program in sorted(PROGRAMS.glob("*.py")):
        with open(program, "rb") as f:
            planted[program.name] = {
                t.start[0] for t in tokenize.tokenize(f.readline)
                if t.type == tokenize.COMMENT and t.string.startswith(MISTAKE)}
    return planted


def _tool(module: str) -> list[str]:
    try:
        importlib.import_module(module)
    except ImportError:
        skip_without(f"{module} is not installed (pip install -e .[test])")
    return [sys.executable, "-m", module]


def _run(cmd: list[str], cwd: pathlib.Path, env: dict) -> tuple[str, float]:
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=CHECK_TIMEOUT_S)
    took = time.monotonic() - start
    if r.returncode not in (0, 1):  # 1: errors were found
        pytest.fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}\n"
                    f"{r.stderr[-4000:]}")
    return r.stdout, took


def pyright(where: pathlib.Path, python: str, extra_paths: list[str], env: dict) -> dict:
    """{file name: {line: [messages]}} of pyright's errors and warnings."""
    (where / "pyrightconfig.json").write_text(json.dumps(
        {"extraPaths": extra_paths, "include": ["."]}))
    out, took = _run([*_tool("pyright"), "--outputjson", "--pythonpath", python, "-p",
                      str(where)], where, env)
    print(f"pyright: {took:.1f} s")
    found: dict = {}
    for d in json.loads(out)["generalDiagnostics"]:
        if d["severity"] in ("error", "warning"):
            line = d["range"]["start"]["line"] + 1
            found.setdefault(pathlib.Path(d["file"]).name, {}).setdefault(line, []).append(
                f"{d['severity']}: {d['message']}")
    return found


def mypy(where: pathlib.Path, python: str, env: dict, cache: pathlib.Path,
         files: list[str]) -> dict:
    """{file name: {line: [messages]}} of mypy's errors in `files`."""
    out, took = _run([*_tool("mypy"), "--python-executable", python, "--cache-dir", str(cache),
                      "--follow-imports=silent", "--show-error-codes", "--no-error-summary",
                      "--no-pretty", *files], where, env)
    print(f"mypy: {took:.1f} s")
    found: dict = {}
    for m in re.finditer(r"^(\S+\.py):(\d+): error: (.*)$", out, re.M):
        found.setdefault(m[1], {}).setdefault(int(m[2]), []).append(m[3])
    return found


def _verdict(checker: str, found: dict, programs: list[str]) -> None:
    """Each program's reported lines are exactly its planted ones. A planted mistake may
    show as two diagnostics of its one line (mypy: an unknown keyword and no matching
    overload; pyright: no matching overload and the closest one's bad argument)."""
    assert set(found) <= set(programs), found
    for program in programs:
        lines = _planted()[program]
        got = found.get(program, {})
        print(f"{checker} on {program}: {sum(map(len, got.values()))} errors", *(
            f"\n  {program}:{line}: {msg.splitlines()[0]}"
            for line in sorted(got) for msg in got[line]))
        assert set(got) == lines, (
            f"{checker} on {program}: expected errors on lines {sorted(lines)}, got:\n"
            + "\n".join(f"  {line}: {msg}" for line in sorted(got) for msg in got[line]))


@pytest.fixture(scope="module")
def mypy_cache(request, tmp_path_factory) -> pathlib.Path:
    """mypy's cache: kept by pytest between runs when its cache plugin is on (torch's
    analysis is most of a first run)."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy") if cache is not None else tmp_path_factory.mktemp("mypy")


def _source_env() -> dict:
    env = dict(os.environ, MYPYPATH=str(ROOT))
    env.pop("PYTHONPATH", None)
    return env


def _installed_typed(python: str, env: dict, package: str) -> bool:
    """Whether `package`, as `python` imports it, has a py.typed (PEP 561: without one
    mypy does not read an installed package)."""
    out, _ = _run([python, "-c", f"import {package}, pathlib; print(pathlib.Path("
                   f"{package}.__file__).with_name('py.typed').is_file())"], ROOT, env)
    return out.strip() == "True"


def _wheel_python() -> tuple[str, dict]:
    """The python of the venv the wheel is installed in (the first call builds it: mark
    its callers with TEST_TIMEOUT_S), and its environment."""
    from . import _wheel

    return str(_wheel.wheel_venv()), _wheel.venv_env()


@pytest.mark.parametrize("where", [
    "source", pytest.param("wheel", marks=pytest.mark.timeout(TEST_TIMEOUT_S))])
def test_checkers_on_user_programs(where, tmp_path, mypy_cache):
    if where == "source":
        python, extra, env = sys.executable, [str(ROOT)], _source_env()
    else:
        (python, env), extra = _wheel_python(), []
        assert _installed_typed(python, env, "mcrdl")
    programs = _programs(tmp_path)
    names = sorted(_planted())
    _verdict("pyright", pyright(programs, python, extra, env), names)
    _verdict("mypy", mypy(programs, python, env, mypy_cache, names), names)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_installed_training_is_typed():
    python, env = _wheel_python()
    assert _installed_typed(python, env, "training")


class LanguageServer:
    """pyright's language server over stdio, as an editor runs it (JSON-RPC, LSP)."""

    def __init__(self, root: pathlib.Path, python: str, env: dict):
        self.python, self.next_id = python, 0
        self.proc = subprocess.Popen([*_tool("pyright.langserver"), "--stdio"], cwd=root,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.request("initialize", {
            "processId": os.getpid(), "rootUri": root.as_uri(),
            "workspaceFolders": [{"uri": root.as_uri(), "name": root.name}],
            "capabilities": {"textDocument": {"hover": {"contentFormat": ["markdown"]}}}})
        self.notify("initialized", {})

    def _send(self, message: dict) -> None:
        data = json.dumps({"jsonrpc": "2.0", **message}).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        length = None
        while (line := self.proc.stdout.readline().strip()):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        assert length is not None, "pyright's language server closed its output"
        return json.loads(self.proc.stdout.read(length))

    def notify(self, method: str, params: dict) -> None:
        self._send({"method": method, "params": params})

    def request(self, method: str, params: dict):
        self.next_id += 1
        self._send({"id": self.next_id, "method": method, "params": params})
        while True:
            message = self._receive()
            if "method" not in message and message.get("id") == self.next_id:
                assert "error" not in message, message
                return message.get("result")
            if "method" in message and "id" in message:  # the server asks the editor
                items = message.get("params", {}).get("items", [])
                self._send({"id": message["id"], "result": [
                    {"pythonPath": self.python} if i.get("section") == "python" else {}
                    for i in items] if message["method"] == "workspace/configuration"
                    else None})

    def close(self) -> None:
        self.request("shutdown", None)
        self.notify("exit", None)
        self.proc.wait(timeout=30)


def test_hover_shows_the_operation_docstring(tmp_path):
    """What an editor shows on `mcrdl.<op>`: the signature of the overload the call
    takes and its docstring (the spec's text, the parameters and their units)."""
    program = tmp_path / "program.py"
    program.write_text("import mcrdl\nimport torch\n\nt = torch.ones(4)\n"
                       "mcrdl.all_reduce('mpi', t)\n"
                       "w = mcrdl.all_gatherv('mpi', t, t, [4], async_op=True)\n")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(ROOT)]}))
    server = LanguageServer(tmp_path, sys.executable, _source_env())
    try:
        text = program.read_text()
        server.notify("textDocument/didOpen", {"textDocument": {
            "uri": program.as_uri(), "languageId": "python", "version": 1, "text": text}})
        shown = {}
        for name in ("all_reduce", "all_gatherv"):
            before = text[:text.index(f"mcrdl.{name}") + len("mcrdl.") + 1]
            position = {"line": before.count("\n"), "character": len(before.split("\n")[-1])}
            hover = server.request("textDocument/hover", {
                "textDocument": {"uri": program.as_uri()}, "position": position})
            shown[name] = hover["contents"]["value"].replace("\\_", "_") if hover else ""
    finally:
        server.close()
    for name, returns in (("all_reduce", "-> None"), ("all_gatherv", "-> Work")):
        assert f"def {name}(" in shown[name] and returns in shown[name], shown[name]
        assert OPS[name].doc.split("`")[0] in shown[name], shown[name]
    assert "element counts (not bytes)" in shown["all_gatherv"], shown["all_gatherv"]
    assert "True: return a Work" in shown["all_reduce"], shown["all_reduce"]


def test_user_programs_run():
    """The calls the checkers accept work: the documented ones (async ones return a
    Work), in a two-rank world; the training program's configs and models."""
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable,
                        str(PROGRAMS / "user_program.py"), "mpi"], env=clean_env(), timeout=300)
    assert "Traceback" not in out, out
    out = run_launcher([sys.executable, str(PROGRAMS / TRAINING_PROGRAM)], env=clean_env(),
                       timeout=300)
    assert "Traceback" not in out, out
