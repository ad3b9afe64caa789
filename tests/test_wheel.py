"""A wheel built from the repository: it holds the tuning tables of the top-level
tuning_tables/ folder as package data, and installed in a fresh venv outside the
repository, "auto" finds the shipped table with no configuration while
MCRDL_TUNING_TABLE still overrides it. The wheel and the venv are built once per pytest
process (tests/_wheel.py), which compiles the C++ core: minutes."""

import json
import pathlib
import subprocess
import zipfile

import pytest

from mcrdl.tuning.schema import decode, read
from mcrdl.tuning.table import TuningTable

from ._wheel import ROOT, TEST_TIMEOUT_S, build_wheel, venv_env, wheel_venv

# the first test to run builds the wheel (minutes)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

TABLES = ROOT / "tuning_tables"
PROBE = pathlib.Path(__file__).resolve().parent / "tuning" / "installed_auto.py"
SHIPPED = sorted(p.name for p in TABLES.glob("*.json"))


def test_the_repository_ships_a_table_and_lists_it():
    """Each table in tuning_tables/ has its row in the folder's README: the machine and
    the exact command that made it, which is the command of its provenance."""
    assert SHIPPED, "no tuning table in tuning_tables/"
    readme = (TABLES / "README.md").read_text()
    for name in SHIPPED:
        prov = decode(read(TABLES / name), source=name).provenance
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` |")),
                   None)
        assert row is not None, f"tuning_tables/README.md has no row for {name}"
        assert prov["command"] in row, (name, prov["command"])
        assert prov["cpu_model"] in row, (name, prov["cpu_model"])


@pytest.fixture(scope="module")
def python() -> pathlib.Path:
    return wheel_venv()


def probe(python: pathlib.Path, tmp_path: pathlib.Path, table: str, **env) -> dict:
    r = subprocess.run([str(python), str(PROBE), table], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**venv_env(), **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_the_tables_as_package_data():
    names = set(zipfile.ZipFile(build_wheel()).namelist())
    for name in [*SHIPPED, "README.md"]:
        assert f"mcrdl/tuning_tables/{name}" in names, name
    for name in ("mcrdl/tuning/mpi_blocking.json", "mcrdl/tuning/mpich_posix_coll.json"):
        assert name in names, name
    assert any(n.startswith("mcrdl/_C") and n.endswith(".so") for n in names)
    assert not any(n.startswith("tuning_tables/") for n in names)  # inside mcrdl only


@pytest.mark.parametrize("name", SHIPPED)
def test_installed_auto_routes_by_the_shipped_table(python, tmp_path, name):
    """On the system a shipped table was measured on, the installed copy's "auto" routes
    by that table, read from the installed package."""
    out = probe(python, tmp_path, name)
    site = python.parent.parent
    assert pathlib.Path(out["mcrdl"]).is_relative_to(site), out["mcrdl"]
    assert pathlib.Path(out["shipped"]) == pathlib.Path(out["mcrdl"]).parent / "tuning_tables"
    assert out["routes_by"] == str(pathlib.Path(out["shipped"]) / name), out
    assert out["digest"] == TuningTable.load(TABLES / name).digest()
    assert out["backend"] == out["predicted"], out


def test_installed_tuning_table_variable_overrides_the_shipped_one(python, tmp_path):
    """MCRDL_TUNING_TABLE wins over the shipped table: here a table in which gloo is the
    faster backend at one rank, where every shipped table (and the fixed rule) says mpi."""
    table = TuningTable({"cpu_model": "test", "gpu_model": ""})
    for n in (8, 64, 1024):
        table.add("all_reduce", 1, "mpi", n, 1e-3)
        table.add("all_reduce", 1, "gloo", n, 1e-6)
    path = tmp_path / "gloo_wins.json"
    table.save(path)
    out = probe(python, tmp_path, SHIPPED[0], MCRDL_TUNING_TABLE=str(path))
    assert out["routes_by"] == str(path), out
    assert out["digest"] == table.digest()
    assert out["backend"] == out["predicted"] == "gloo", out
