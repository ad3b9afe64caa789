"""Tuning tables (mcrdl.tuning.table, .schema, .provenance) and the alpha-beta model
(mcrdl.tuning.model): round trip, atomic save, schema validation, lookup at exact /
in-between / out-of-range points, provenance, shipped-table choice, the model fit, and
the cost of a lookup."""

import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import mcrdl
from mcrdl.tuning import model as mdl
from mcrdl.tuning import schema
from mcrdl.tuning import table as tbl
from mcrdl.tuning.model import AlphaBeta, coefficients, fit, holdout_error
from mcrdl.tuning.provenance import SHIPPED_TABLES, current_provenance, find_shipped_table
from mcrdl.tuning.schema import SCHEMA, VERSION, TuningTableError
from mcrdl.tuning.table import TuningTable

README = SHIPPED_TABLES / "README.md"
PROV = {"host": "node01", "system": "test", "cpu_model": "cpu X", "gpu_model": "",
        "mpi": "MPICH Version:      5.0.2", "torch": "2.13.0+cpu", "nccl": "",
        "gloo": "torch 2.13.0+cpu", "date": "2025-01-31T12:00:00+00:00", "command": "pytest"}
POW2 = [1 << k for k in range(3, 21)]  # 8 B .. 1 MiB


def model_table(params: dict, op: str = "all_reduce", group_sizes=(2, 4), sizes=POW2,
                provenance=PROV) -> TuningTable:
    """A table whose times are exactly the alpha-beta model of each backend."""
    t = TuningTable(provenance)
    for backend, (alpha, beta) in params.items():
        m = AlphaBeta(alpha, beta, op)
        for g in group_sizes:
            for n in sizes:
                t.add(op, g, backend, n, m.predict(g, n))
    return t


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def valid_doc() -> dict:
    t = TuningTable(PROV)
    for n, (tm, tg) in zip((8, 16, 32), ((1e-6, 2e-6), (2e-6, 3e-6), (3e-6, 4e-6)),
                           strict=True):
        t.add("all_reduce", 4, "mpi", n, tm)
        t.add("all_reduce", 4, "gloo", n, tg)
    return t.to_dict()


# -- round trip and atomic save ---------------------------------------------------------


def test_round_trip_keeps_points_and_provenance(tmp_path):
    prov = current_provenance("mcrdl-tune run --output t.json")
    prov["system"] = "2-core test VM"
    t = TuningTable(prov)
    t.add("all_reduce", 2, "mpi", 8, 1.25e-6)
    t.add("all_reduce", 2, "mpi", 1024, 3.5e-6)
    t.add("all_reduce", 2, "gloo", 1024, 2.0e-6)  # gloo has no 8 B point: null in JSON
    t.add("all_reduce", 4, "gloo", 8, 5e-6)
    t.add("all_gather@overlap4", 4, "pccl", 64, 7.123456789012345e-6)
    t.add("barrier", 4, "mpi", 0, 9e-6)
    t.add("all_reduce", 2, "mpi", 8, 1.5e-6)  # re-adding replaces
    path = tmp_path / "t.json"
    t.save(path)
    back = TuningTable.load(path)
    assert back == t
    assert back.provenance == prov
    assert back.points("all_reduce", 2, "mpi") == ([8, 1024], [1.5e-6, 3.5e-6])
    assert back.points("all_gather@overlap4", 4, "pccl") == ([64], [7.123456789012345e-6])
    assert back.ops() == ["all_gather@overlap4", "all_reduce", "barrier"]
    assert back.group_sizes("all_reduce") == [2, 4]
    assert back.backends() == ["gloo", "mpi", "pccl"]
    assert back.backends("all_reduce") == ["gloo", "mpi"]
    assert back.has("all_reduce", 2, "mpi", 1024) and not back.has("all_reduce", 2, "gloo", 8)
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and doc["version"] == VERSION
    entry = doc["ops"]["all_reduce"]["2"]
    assert entry == {"sizes": [8, 1024], "times": {"gloo": [None, 2.0e-6], "mpi": [1.5e-6, 3.5e-6]},
                     "winners": [[8, "mpi"], [1024, "gloo"]]}
    assert TuningTable.from_dict(t.to_dict()) == t
    assert TuningTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_winners_are_rederived_from_times():
    doc = valid_doc()
    doc["ops"]["all_reduce"]["4"]["winners"] = [[8, "gloo"]]  # wrong, but well formed
    t = TuningTable.from_dict(doc)
    assert t.winners("all_reduce", 4) == [(8, "mpi")]
    assert t.winners("all_reduce", 99) == [] and t.winners("nope", 4) == []


def test_readme_example_is_a_valid_table():
    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), re.S)
    t = TuningTable.from_dict(json.loads(blocks[0]), source="README.md")
    assert t.winners("all_reduce", 4) == [(8, "mpi"), (32, "gloo")]
    assert t.points("all_reduce", 4, "mpi") == ([8, 16], [1.2e-6, 1.3e-6])
    assert t.to_dict()["ops"]["all_reduce"]["4"] == json.loads(blocks[0])["ops"]["all_reduce"]["4"]


def _boom(*args, **kwargs):
    raise OSError("disk full (injected)")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("target, fault", [("fsync", _boom), ("replace", _boom),
                                           ("fsync", _interrupt), ("dumps", _boom)])
def test_interrupted_save_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch, target,
                                                            fault):
    path = tmp_path / "t.json"
    old = model_table({"mpi": (1e-6, 1e-9)})
    old.save(path)
    before = path.read_bytes()
    new = model_table({"mpi": (1e-6, 1e-9), "gloo": (2e-6, 1e-10)})
    with monkeypatch.context() as m:
        m.setattr(schema.json if target == "dumps" else schema.os, target, fault)
        with pytest.raises((OSError, KeyboardInterrupt)):
            new.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["t.json"]
    assert TuningTable.load(path) == old
    new.save(path)
    assert TuningTable.load(path) == new
    assert os.listdir(tmp_path) == ["t.json"]


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(schema.os, "replace", _boom)
    with pytest.raises(OSError):
        model_table({"mpi": (1e-6, 1e-9)}).save(tmp_path / "t.json")
    assert os.listdir(tmp_path) == []


def test_save_keeps_file_mode(tmp_path):
    path = tmp_path / "t.json"
    t = model_table({"mpi": (1e-6, 1e-9)})
    t.save(path)
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o664)
    t.save(path)
    assert path.stat().st_mode & 0o777 == 0o664


# -- validation -------------------------------------------------------------------------

E = '$.ops["all_reduce"]["4"]'


def _set(path, value):
    def mutate(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[last] = value
    return mutate


def _delete(path):
    def mutate(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        del d[last]
    return mutate


def _rename_group(new_key):
    def mutate(d):
        d["ops"]["all_reduce"][new_key] = d["ops"]["all_reduce"].pop("4")
    return mutate


def _rename_op(new_name):
    def mutate(d):
        d["ops"][new_name] = d["ops"].pop("all_reduce")
    return mutate


BAD_DOCS = [
    # rows under a name no lookup uses would load and be ignored
    ("alias op", _rename_op("broadcast"), '$.ops["broadcast"]', 'own name "bcast"'),
    ("unknown op", _rename_op("allreduce"), '$.ops["allreduce"]', "an mcrdl operation ("),
    ("bad mode", _rename_op("all_reduce@overlap1"), '$.ops["all_reduce@overlap1"]',
     '"all_reduce@overlap<K>" with K >= 2'),
    ("schema", _set(["schema"], "other-table"), "$.schema", '"mcrdl-tuning-table"'),
    ("version 5", _set(["version"], 5), "$.version",
     "expected 1, 2, 3 or 4 (the table was written by a newer mcrdl: upgrade mcrdl"),
    ("version str", _set(["version"], "1"), "$.version",
     "expected 1, 2, 3 or 4 (this mcrdl reads"),
    ("v3 confirmed", lambda d: (d.update(version=3), _set(
        ["ops", "all_reduce", "4", "confirmed"], [8])(d)), E, "unknown key 'confirmed'"),
    ("confirmed int", _set(["ops", "all_reduce", "4", "confirmed"], 8), f"{E}.confirmed",
     "a list of sizes of this entry"),
    ("confirmed size", _set(["ops", "all_reduce", "4", "confirmed"], [8, 64]),
     f"{E}.confirmed[1]", "a size of this entry's sizes"),
    ("confirmed float", _set(["ops", "all_reduce", "4", "confirmed"], [8.0]),
     f"{E}.confirmed[0]", "a size of this entry's sizes"),
    ("version bool", _set(["version"], True), "$.version", "re-run mcrdl-tune run"),
    ("v1 variants", lambda d: (d.update(version=1), _set(
        ["ops", "all_reduce", "4", "variants"], {})(d)), E, "unknown key 'variants'"),
    ("variants list", _set(["ops", "all_reduce", "4", "variants"], []), f"{E}.variants",
     "an object"),
    ("variants backend", _set(["ops", "all_reduce", "4", "variants"],
                              {"nccl": {"blocking": [1e-6] * 3}}),
     f'{E}.variants["nccl"]', "a backend of this entry's times"),
    ("variant name", _set(["ops", "all_reduce", "4", "variants"], {"mpi": {"fast": [1e-6] * 3}}),
     f'{E}.variants["mpi"]', "unknown key 'fast'"),
    ("variant short", _set(["ops", "all_reduce", "4", "variants"], {"mpi": {"blocking": [1e-6]}}),
     f'{E}.variants["mpi"].blocking', "a list of 3 times (one per size), got 1 entries"),
    ("variant nan", _set(["ops", "all_reduce", "4", "variants"],
                         {"mpi": {"nonblocking": [1e-6, math.nan, None]}}),
     f'{E}.variants["mpi"].nonblocking[1]', "got nan"),
    ("blocking list", _set(["ops", "all_reduce", "4", "blocking"], [[8, True]]),
     f"{E}.blocking", "an object"),
    ("steps empty", _set(["ops", "all_reduce", "4", "blocking"], {"mpi": []}),
     f'{E}.blocking["mpi"]', "a non-empty list of [largest bytes, blocking] pairs"),
    ("steps unsorted", _set(["ops", "all_reduce", "4", "blocking"],
                            {"mpi": [[64, True], [8, False]]}),
     f'{E}.blocking["mpi"][1][0]', "increasing order"),
    ("steps -1 first", _set(["ops", "all_reduce", "4", "blocking"],
                            {"mpi": [[-1, True], [8, False]]}),
     f'{E}.blocking["mpi"][1][0]', "-1 (no limit) only last"),
    ("steps -2", _set(["ops", "all_reduce", "4", "blocking"], {"mpi": [[-2, True]]}),
     f'{E}.blocking["mpi"][0][0]', "sizes >= 0"),
    ("steps flag int", _set(["ops", "all_reduce", "4", "blocking"], {"mpi": [[8, 1]]}),
     f'{E}.blocking["mpi"][0]', "an integer and a boolean"),
    ("steps size bool", _set(["ops", "all_reduce", "4", "blocking"], {"mpi": [[True, True]]}),
     f'{E}.blocking["mpi"][0]', "an integer and a boolean"),
    ("no ops", _delete(["ops"]), "$:", "'ops'"),
    ("no schema", _delete(["schema"]), "$:", "'schema'"),
    ("unknown top key", _set(["extra"], 1), "$:", "unknown key 'extra'"),
    ("provenance list", _set(["provenance"], []), "$.provenance", "an object"),
    ("provenance int", _set(["provenance", "torch"], 2), '$.provenance["torch"]', "a string"),
    ("provenance obj", _set(["provenance", "x"], {"a": 1}), '$.provenance["x"]', "number"),
    ("ops list", _set(["ops"], []), "$.ops", "an object"),
    ("op value", _set(["ops", "all_reduce"], [1]), '$.ops["all_reduce"]', "an object"),
    ("empty op", _set(["ops", ""], {}), '$.ops[""]', "non-empty operation name"),
    ("group x", _rename_group("x"), '$.ops["all_reduce"]["x"]', "group size key"),
    ("group 0", _rename_group("0"), '$.ops["all_reduce"]["0"]', "integer >= 1"),
    ("group 04", _rename_group("04"), '$.ops["all_reduce"]["04"]', "integer >= 1"),
    ("group -4", _rename_group("-4"), '$.ops["all_reduce"]["-4"]', "integer >= 1"),
    ("entry list", _set(["ops", "all_reduce", "4"], []), E, '"sizes", "times"'),
    ("no times", _delete(["ops", "all_reduce", "4", "times"]), E, "'times'"),
    ("entry typo", _set(["ops", "all_reduce", "4", "time"], {}), E, "unknown key 'time'"),
    ("sizes str", _set(["ops", "all_reduce", "4", "sizes"], "8"), f"{E}.sizes", "a list"),
    ("unsorted", _set(["ops", "all_reduce", "4", "sizes"], [8, 32, 16]), f"{E}.sizes[2]",
     "strictly increasing"),
    ("duplicate", _set(["ops", "all_reduce", "4", "sizes"], [8, 8, 32]), f"{E}.sizes[1]",
     "no duplicates"),
    ("negative size", _set(["ops", "all_reduce", "4", "sizes"], [-8, 16, 32]),
     f"{E}.sizes[0]", "integer number of bytes >= 0"),
    ("float size", _set(["ops", "all_reduce", "4", "sizes"], [8, 16.5, 32]), f"{E}.sizes[1]",
     "integer number of bytes"),
    ("bool size", _set(["ops", "all_reduce", "4", "sizes"], [True, 16, 32]), f"{E}.sizes[0]",
     "integer number of bytes"),
    ("times list", _set(["ops", "all_reduce", "4", "times"], [1e-6]), f"{E}.times",
     "an object"),
    ("short times", _set(["ops", "all_reduce", "4", "times", "mpi"], [1e-6, 2e-6]),
     f'{E}.times["mpi"]', "a list of 3 times (one per size), got 2 entries"),
    ("times scalar", _set(["ops", "all_reduce", "4", "times", "mpi"], 1e-6),
     f'{E}.times["mpi"]', "a list of 3 times"),
    ("negative time", _set(["ops", "all_reduce", "4", "times", "mpi"], [1e-6, -2e-6, None]),
     f'{E}.times["mpi"][1]', "finite time in seconds >= 0"),
    ("nan time", _set(["ops", "all_reduce", "4", "times", "mpi"], [math.nan, 1e-6, 1e-6]),
     f'{E}.times["mpi"][0]', "got nan"),
    ("inf time", _set(["ops", "all_reduce", "4", "times", "mpi"], [1e-6, 1e-6, math.inf]),
     f'{E}.times["mpi"][2]', "got inf"),
    ("str time", _set(["ops", "all_reduce", "4", "times", "mpi"], ["1e-6", 1e-6, 1e-6]),
     f'{E}.times["mpi"][0]', "(string)"),
    ("bool time", _set(["ops", "all_reduce", "4", "times", "mpi"], [True, 1e-6, 1e-6]),
     f'{E}.times["mpi"][0]', "(boolean)"),
    ("empty backend", _set(["ops", "all_reduce", "4", "times", ""], [1e-6, 1e-6, 1e-6]),
     f'{E}.times[""]', "non-empty backend name"),
    ("winners dict", _set(["ops", "all_reduce", "4", "winners"], {}), f"{E}.winners",
     "[from_bytes, backend] pairs"),
    ("winner shape", _set(["ops", "all_reduce", "4", "winners"], [[8, "mpi"], [16]]),
     f"{E}.winners[1]", "a [from_bytes, backend] pair"),
]


@pytest.mark.parametrize("mutate, path, expected", [b[1:] for b in BAD_DOCS],
                         ids=[b[0] for b in BAD_DOCS])
def test_schema_errors_name_file_path_and_expectation(mutate, path, expected):
    doc = valid_doc()
    TuningTable.from_dict(copy.deepcopy(doc))  # the unmutated document is valid
    mutate(doc)
    with pytest.raises(TuningTableError) as info:
        TuningTable.from_dict(doc, source="crafted.json")
    msg = str(info.value)
    assert msg.startswith(f"crafted.json: {path}"), msg
    assert expected in msg, msg


def test_not_an_object():
    with pytest.raises(TuningTableError, match=r"^x.json: \$: expected a JSON object"):
        TuningTable.from_dict([1, 2], source="x.json")


def test_error_classes():
    assert issubclass(TuningTableError, mcrdl.InvalidArgumentError)
    assert issubclass(TuningTableError, ValueError)


def test_readme_error_example_is_verbatim():
    doc = valid_doc()
    doc["ops"]["all_reduce"]["4"]["sizes"] = [8, 32, 16]
    with pytest.raises(TuningTableError) as info:
        TuningTable.from_dict(doc, source="t.json")
    assert str(info.value) in README.read_text()


def test_load_errors(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(TuningTableError, match="missing.json: no such tuning table"):
        TuningTable.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "schema": "mcrdl-tuning-table",\n  "version": 1\n  "ops": {}\n}\n')
    with pytest.raises(TuningTableError) as info:
        TuningTable.load(bad)
    assert "bad.json: invalid JSON at line 4, column 3" in str(info.value)
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(TuningTableError, match="empty.json: empty file"):
        TuningTable.load(empty)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(valid_doc()).replace("1e-06", "NaN", 1))
    with pytest.raises(TuningTableError, match=r'nan.json: .*times\["mpi"\]\[0\].*got nan'):
        TuningTable.load(nan)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(TuningTableError, match="binary.json: not UTF-8"):
        TuningTable.load(binary)
    with pytest.raises(TuningTableError, match="cannot read the tuning table"):
        TuningTable.load(tmp_path)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "other", "version": 1, "provenance": {}, "ops": {}}))
    with pytest.raises(TuningTableError, match=r"wrong.json: \$.schema: expected"):
        TuningTable.load(wrong)
    old = tmp_path / "v0.json"
    old.write_text(json.dumps({**valid_doc(), "version": 0}))
    with pytest.raises(TuningTableError, match=r"v0.json: \$.version: expected 1, 2, 3 or 4 "
                       r"\(this mcrdl reads versions 1, 2, 3, 4; re-run mcrdl-tune run"):
        TuningTable.load(old)


@pytest.mark.parametrize("args", [
    ("", 4, "mpi", 8, 1e-6), (3, 4, "mpi", 8, 1e-6), ("all_reduce", 0, "mpi", 8, 1e-6),
    ("all_reduce", 2.0, "mpi", 8, 1e-6), ("all_reduce", True, "mpi", 8, 1e-6),
    ("all_reduce", 4, "", 8, 1e-6), ("all_reduce", 4, "mpi", -1, 1e-6),
    ("all_reduce", 4, "mpi", 8.5, 1e-6), ("all_reduce", 4, "mpi", 8, -1e-6),
    ("all_reduce", 4, "mpi", 8, math.nan), ("all_reduce", 4, "mpi", 8, math.inf),
    ("all_reduce", 4, "mpi", 8, "1e-6"),
])
def test_add_rejects_bad_points(args):
    with pytest.raises(TuningTableError, match="add"):
        TuningTable().add(*args)


def test_bad_provenance_rejected():
    with pytest.raises(TuningTableError, match=r'\$.provenance\["host"\]: expected a string'):
        TuningTable({"host": 3})
    t = TuningTable()
    t.provenance["date"] = math.nan  # set after construction: caught before writing
    with pytest.raises(TuningTableError, match="date"):
        t.to_dict()


# -- lookup: exact, in between, out of range --------------------------------------------


def test_lookup_at_exact_points():
    t = TuningTable()
    times = {"mpi": [1e-6, 5e-6, 4e-5], "gloo": [3e-6, 4e-6, 5e-5]}
    for b, ts in times.items():
        for n, s in zip((8, 1024, 65536), ts, strict=True):
            t.add("bcast", 4, b, n, s)
    both = ("mpi", "gloo")
    assert [t.lookup("bcast", 4, n, both) for n in (8, 1024, 65536)] == ["mpi", "gloo", "mpi"]
    for b, ts in times.items():
        assert [t.predict("bcast", 4, n, b) for n in (8, 1024, 65536)] == ts
    assert t.winners("bcast", 4) == [(8, "mpi"), (1024, "gloo"), (65536, "mpi")]


def test_winner_flips_at_the_log_log_crossover():
    # mpi: 1 us at 1 KiB, 16 us at 4 KiB -> t = 1 us * (n / 1024)^2 in between
    # gloo: 2 us flat; crossover (n / 1024)^2 = 2  ->  n = 1024 * sqrt(2) = 1448.15
    t = TuningTable()
    t.add("all_reduce", 4, "mpi", 1024, 1e-6)
    t.add("all_reduce", 4, "mpi", 4096, 16e-6)
    t.add("all_reduce", 4, "gloo", 1024, 2e-6)
    t.add("all_reduce", 4, "gloo", 4096, 2e-6)
    both = ("mpi", "gloo")
    assert t.predict("all_reduce", 4, 3000, "mpi") == pytest.approx(1e-6 * (3000 / 1024) ** 2)
    assert t.predict("all_reduce", 4, 3000, "gloo") == pytest.approx(2e-6)
    assert t.lookup("all_reduce", 4, 1448, both) == "mpi"
    assert t.lookup("all_reduce", 4, 1449, both) == "gloo"
    assert t.lookup("all_reduce", 4, 2048, both) == "gloo"


def test_zero_byte_segment_is_linear():
    t = TuningTable()
    t.add("all_reduce", 2, "mpi", 0, 1e-6)
    t.add("all_reduce", 2, "mpi", 1000, 3e-6)
    assert t.predict("all_reduce", 2, 250, "mpi") == pytest.approx(1.5e-6)
    assert t.predict("all_reduce", 2, 0, "mpi") == 1e-6


def test_between_measured_group_sizes_interpolates_in_log_group_size():
    # at 64 B: mpi 1 us at 2 ranks, 16 us at 8 ranks -> t = 1 us * (g / 2)^2 in between
    # gloo 3 us at both; crossover (g / 2)^2 = 3 -> g = 3.46: mpi at 3 ranks, gloo at 4
    t = TuningTable()
    for g, tm in ((2, 1e-6), (8, 16e-6)):
        t.add("all_gather", g, "mpi", 64, tm)
        t.add("all_gather", g, "gloo", 64, 3e-6)
    assert t.predict("all_gather", 4, 64, "mpi") == pytest.approx(4e-6)  # geometric mean
    assert t.predict("all_gather", 3, 64, "mpi") == pytest.approx(2.25e-6)
    assert t.predict("all_gather", 6, 64, "gloo") == pytest.approx(3e-6)
    both = ["mpi", "gloo"]
    assert [t.lookup("all_gather", g, 64, both) for g in (2, 3, 4, 5, 8)] == \
        ["mpi", "mpi", "gloo", "gloo", "gloo"]


def test_beyond_measured_sizes_follows_the_model():
    # t(4, n) = 4 alpha + 1.5 beta n (all_reduce, 4 ranks); mpi wins every measured size
    # (<= 1 MiB) but its bandwidth is worse: crossover at
    # n* = 4 (1e-4 - 1e-6) / (1.5 (1e-10 - 5e-11)) = 5,280,000 B
    params = {"mpi": (1e-6, 1e-10), "gloo": (1e-4, 5e-11)}
    t = model_table(params)
    both = ("mpi", "gloo")
    assert t.winners("all_reduce", 4) == [(8, "mpi")]
    assert t.lookup("all_reduce", 4, 5_279_000, both) == "mpi"
    assert t.lookup("all_reduce", 4, 5_281_000, both) == "gloo"
    for b, (alpha, beta) in params.items():
        m = AlphaBeta(alpha, beta, "all_reduce")
        for n in (0, 3, 1 << 24, 1 << 30):
            assert rel(t.predict("all_reduce", 4, n, b), m.predict(4, n)) < 1e-9
        fitted = t.model("all_reduce", b)
        assert rel(fitted.alpha, alpha) < 1e-9 and rel(fitted.beta, beta) < 1e-9


def test_beyond_measured_group_sizes_follows_the_model():
    params = {"mpi": (1e-6, 1e-10), "gloo": (1e-4, 5e-11)}
    t = model_table(params)
    for g in (1, 16, 1024):
        for n in (8, 1 << 16, 1 << 26):
            want = {b: AlphaBeta(a, be, "all_reduce").predict(g, n)
                    for b, (a, be) in params.items()}
            for b in params:
                assert rel(t.predict("all_reduce", g, n, b), want[b]) < 1e-9
            assert t.lookup("all_reduce", g, n, params) == min(want, key=want.get)
    # at 16 ranks: 8 alpha + 1.875 beta n; crossover n* = 8 * 9.9e-5 / (1.875 * 5e-11)
    n_star = 8 * 9.9e-5 / (1.875 * 5e-11)
    assert t.lookup("all_reduce", 16, int(n_star * 0.99), params) == "mpi"
    assert t.lookup("all_reduce", 16, int(n_star * 1.01), params) == "gloo"


def test_extrapolation_is_anchored_at_the_nearest_measured_point():
    rng = np.random.default_rng(7)
    t = TuningTable()
    m = AlphaBeta(2e-6, 3e-10, "all_to_all")
    for g in (2, 4):
        for n in POW2:
            t.add("all_to_all", g, "mpi", n, m.predict(g, n) * rng.uniform(0.8, 1.25))
    fitted = t.model("all_to_all", "mpi")
    top, t_top = POW2[-1], t.points("all_to_all", 4, "mpi")[1][-1]
    assert rel(t.predict("all_to_all", 4, top + 1, "mpi"), t_top) < 1e-5  # continuous
    for n in (1 << 22, 1 << 28):
        want = t_top * fitted.predict(4, n) / fitted.predict(4, top)
        assert rel(t.predict("all_to_all", 4, n, "mpi"), want) < 1e-12
    t_g4 = t.points("all_to_all", 4, "mpi")[1][5]
    want = t_g4 * fitted.predict(32, POW2[5]) / fitted.predict(4, POW2[5])
    assert rel(t.predict("all_to_all", 32, POW2[5], "mpi"), want) < 1e-12


def three_lines() -> TuningTable:
    """all_to_all at 4 ranks: mpi = 1 us + n ns, gloo = 10 us + n/10 ns, pccl = 100 us +
    n/100 ns; crossovers by hand: mpi/gloo at n = 1e4 B, gloo/pccl at n = 1e6 B."""
    t = TuningTable()
    lines = {"mpi": (1e-6, 1e-9), "gloo": (1e-5, 1e-10), "pccl": (1e-4, 1e-11)}
    for b, (a, s) in lines.items():
        for n in POW2:
            t.add("all_to_all", 4, b, n, a + s * n)
    return t


def test_auto_resolves_to_each_of_three_backends():
    t = three_lines()
    names = ("mpi", "gloo", "pccl")
    assert t.winners("all_to_all", 4) == [(8, "mpi"), (16384, "gloo"), (1 << 20, "pccl")]
    assert t.lookup("all_to_all", 4, 64, names) == "mpi"
    assert t.lookup("all_to_all", 4, 8192, names) == "mpi"
    assert t.lookup("all_to_all", 4, 65536, names) == "gloo"
    assert t.lookup("all_to_all", 4, 1 << 20, names) == "pccl"
    assert t.lookup("all_to_all", 4, 1 << 26, names) == "pccl"
    assert t.lookup("all_to_all", 4, 5, names) == "mpi"  # below the smallest size


def test_lookup_only_returns_requested_backends():
    t = three_lines()
    for n in (8, 1 << 14, 1 << 20, 1 << 26):
        for g in (2, 4, 16):
            assert t.lookup("all_to_all", g, n, ("mpi", "gloo")) in ("mpi", "gloo")
            assert t.lookup("all_to_all", g, n, ["gloo", "pccl"]) in ("gloo", "pccl")
            assert t.lookup("all_to_all", g, n, {"pccl"}) == "pccl"
            assert t.lookup("all_to_all", g, n, frozenset({"mpi"})) == "mpi"
    assert t.lookup("all_to_all", 4, 1 << 20, iter(["mpi", "gloo"])) == "gloo"
    assert t.lookup("all_to_all", 4, 1 << 20, "mpi") == "mpi"  # one name
    assert t.lookup("all_to_all", 4, 8, ("nccl",)) is None  # no data for it
    assert t.lookup("all_to_all", 4, 8, ()) is None
    assert t.lookup("all_reduce", 4, 8, ("mpi",)) is None  # no data for the op
    assert t.predict("all_to_all", 4, 8, "nccl") is None
    with pytest.raises(mcrdl.InvalidArgumentError):
        t.predict("all_to_all", 0, 8, "mpi")
    with pytest.raises(mcrdl.InvalidArgumentError):
        t.predict("all_to_all", 4, -1, "mpi")


def test_lookup_cache_follows_new_points_and_is_bounded(monkeypatch):
    t = TuningTable()
    t.add("all_reduce", 2, "mpi", 8, 1e-6)
    t.add("all_reduce", 2, "gloo", 8, 2e-6)
    assert t.lookup("all_reduce", 2, 8, ("mpi", "gloo")) == "mpi"
    t.add("all_reduce", 2, "gloo", 8, 0.5e-6)  # re-measured: the cached answer goes
    assert t.lookup("all_reduce", 2, 8, ("mpi", "gloo")) == "gloo"
    monkeypatch.setattr(tbl, "_CACHE_MAX", 100)
    for n in range(1000):
        t.lookup("all_reduce", 2, n, ("mpi", "gloo"))
        assert len(t._lookup_cache) <= 100
    assert t.lookup("all_reduce", 2, 999, ("mpi", "gloo")) == "gloo"


def test_unmodelled_op_extrapolates_with_point_to_point_model():
    t = TuningTable()
    for n in (8, 64, 512):
        t.add("my_plugin_op", 2, "x", n, 1e-6 + 1e-9 * n)
    assert t.model("my_plugin_op", "x").op == "send"
    assert rel(t.predict("my_plugin_op", 2, 4096, "x"), 1e-6 + 1e-9 * 4096) < 1e-9


def test_repeated_lookup_is_a_cache_hit():
    """A repeated lookup is a dict lookup: no prediction runs again (its cost in time is
    a benchmark's subject, not a test's)."""
    t = model_table({"mpi": (1e-6, 1e-10), "gloo": (1e-4, 5e-11), "pccl": (5e-5, 2e-11)},
                    group_sizes=(2, 4, 8))
    names = ("gloo", "mpi", "pccl")
    calls = [("all_reduce", g, n) for g in (2, 3, 8, 16) for n in (0, 100, 4096, 1 << 24)]
    resolve, resolved = t._resolve, []

    def counted(key):
        resolved.append(key)
        return resolve(key)

    t._resolve = counted
    first = [t.lookup(op, g, n, names) for op, g, n in calls]
    assert len(resolved) == len(calls)
    for _ in range(100):
        assert [t.lookup(op, g, n, names) for op, g, n in calls] == first
    assert len(resolved) == len(calls), "a cached lookup ran the prediction again"


# -- provenance -------------------------------------------------------------------------


def test_stale_reasons():
    t = TuningTable(PROV)
    assert t.stale_reasons(dict(PROV)) == []
    assert t.stale_reasons({**PROV, "host": "other", "date": "now", "command": "x"}) == []
    reasons = t.stale_reasons({**PROV, "torch": "2.14.0+cpu", "mpi": "Open MPI v5.0.3"})
    assert len(reasons) == 2
    assert any("torch" in r and "2.13.0+cpu" in r and "2.14.0+cpu" in r for r in reasons)
    assert any("MPI" in r and "MPICH" in r and "Open MPI v5.0.3" in r for r in reasons)
    assert t.stale_reasons({"torch": "2.13.0+cpu"}) == []  # missing keys are not compared
    assert t.stale_reasons({**PROV, "nccl": "2.21.5"}) == []  # "" in the table: unknown
    assert TuningTable({"mpi": "crafted"}).stale_reasons({"torch": "x", "gloo": "y"}) == []
    assert TuningTable({"gloo": "torch 2.1"}).stale_reasons({"gloo": "torch 2.13"}) == [
        "Gloo: table measured with 'torch 2.1', running 'torch 2.13'"]
    # MPICH's collective selection changes what blocking calls cost (tables before it: [])
    assert t.stale_reasons({**PROV, "mpich_coll_selection": "mpich"}) == []
    assert TuningTable({**PROV, "mpich_coll_selection": "mcrdl"}).stale_reasons(
        {**PROV, "mpich_coll_selection": "mpich"}) == [
        "MPICH collective selection: table measured with 'mcrdl', running 'mpich'"]


def test_mpich_coll_selection(monkeypatch, tmp_path):
    from mcrdl.bootstrap import MPICH_POSIX_COLL_CVAR, mpich_posix_coll_json
    from mcrdl.tuning.provenance import mpich_coll_selection

    monkeypatch.delenv(MPICH_POSIX_COLL_CVAR, raising=False)
    assert mpich_coll_selection() == "mpich"
    monkeypatch.setenv(MPICH_POSIX_COLL_CVAR, "")
    assert mpich_coll_selection() == "mpich"
    monkeypatch.setenv(MPICH_POSIX_COLL_CVAR, mpich_posix_coll_json())
    with open(mpich_posix_coll_json()) as f:  # the file's version: its content's digest
        canonical = json.dumps(json.load(f), separators=(",", ":")).encode()
    assert mpich_coll_selection() == "mcrdl:" + hashlib.sha256(canonical).hexdigest()[:12]
    mine = str(tmp_path / "sel.json")
    monkeypatch.setenv(MPICH_POSIX_COLL_CVAR, mine)
    assert mpich_coll_selection() == mine


def test_current_provenance():
    import socket

    import torch

    p = current_provenance("mcrdl-tune run --output x.json")
    assert set(p) >= set(schema.PROVENANCE_KEYS)
    assert all(isinstance(v, str) for v in p.values())
    assert p["host"] == socket.gethostname()
    assert p["torch"] == torch.__version__
    assert p["command"] == "mcrdl-tune run --output x.json"
    assert p["cpu_model"]
    assert p["date"].endswith("+00:00") and p["date"][:4].isdigit()
    if not torch.cuda.is_available():
        assert p["gpu_model"] == "" and p["nccl"] == ""
    if "mpi4py.MPI" in sys.modules:
        first = sys.modules["mpi4py.MPI"].Get_library_version().strip().splitlines()[0]
        assert p["mpi"] == first.strip()
    from mcrdl.tuning.provenance import mpich_coll_selection
    assert p["mpich_coll_selection"] == (mpich_coll_selection() if "MPICH" in p["mpi"] else "")
    TuningTable(p)  # valid provenance


def test_current_provenance_does_not_import_mpi():
    code = ("import sys; import mcrdl.tuning.provenance as t; before = 'mpi4py.MPI' in sys.modules;"
            "p = t.current_provenance(); print(before, 'mpi4py.MPI' in sys.modules, p['mpi'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == out[1] == "False" and len(out) == 2  # mpi is "" when MPI is not loaded
    code = ("from mpi4py import MPI; import mcrdl.tuning.provenance as t;"
            "print(t.current_provenance()['mpi'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out and "\n" not in out


def test_find_shipped_table(tmp_path):
    here = {"host": "node07", "cpu_model": "cpu X", "gpu_model": ""}
    tables = {
        "other_cpu.json": {**PROV, "cpu_model": "cpu Y", "host": "node07"},
        "gpu.json": {**PROV, "gpu_model": "NVIDIA H100", "host": "node07"},
        "same_kind_old.json": {**PROV, "host": "node01", "date": "2024-01-01T00:00:00+00:00"},
        "same_kind_new.json": {**PROV, "host": "node02", "date": "2025-06-01T00:00:00+00:00"},
        "same_host.json": {**PROV, "host": "node07", "date": "2023-01-01T00:00:00+00:00"},
        "no_models.json": {"host": "node07"},
    }
    for name, prov in tables.items():
        model_table({"mpi": (1e-6, 1e-9)}, sizes=[8], provenance=prov).save(tmp_path / name)
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("not a table")
    assert find_shipped_table(tmp_path, here) == tmp_path / "same_host.json"
    (tmp_path / "same_host.json").unlink()
    assert find_shipped_table(tmp_path, here) == tmp_path / "same_kind_new.json"
    assert find_shipped_table(str(tmp_path), {**here, "host": "x"}) == \
        tmp_path / "same_kind_new.json"
    assert find_shipped_table(tmp_path, {**here, "gpu_model": "NVIDIA H100"}) == \
        tmp_path / "gpu.json"
    assert find_shipped_table(tmp_path, {**here, "cpu_model": "cpu Z"}) is None
    assert find_shipped_table(tmp_path, {}) is None
    assert find_shipped_table(tmp_path / "nowhere", here) is None


def test_find_shipped_table_matches_this_machine(tmp_path):
    current = current_provenance()
    model_table({"mpi": (1e-6, 1e-9)}, sizes=[8], provenance=current).save(tmp_path / "a.json")
    assert find_shipped_table(tmp_path, current_provenance()) == tmp_path / "a.json"


# -- the alpha-beta model ---------------------------------------------------------------


def test_coefficients():
    p = 8
    assert coefficients("all_reduce", p) == (6.0, 1.75)
    assert coefficients("all_reduce@overlap4", p) == (6.0, 1.75)
    assert coefficients("reduce", p) == coefficients("bcast", p) == (3.0, 1.0)
    for op in ("gather", "gatherv", "scatter", "scatterv"):
        assert coefficients(op, p) == (3.0, 0.875)
    for op in ("all_gather", "all_gatherv", "reduce_scatter", "all_to_all",
               "all_to_all_single", "all_to_allv"):
        assert coefficients(op, p) == (7.0, 0.875)
    assert coefficients("barrier", p) == (3.0, 0.0)
    assert coefficients("send", p) == coefficients("recv", 2) == (1.0, 1.0)
    assert coefficients("all_reduce", 5) == (6.0, 1.6)  # ceil(log2 5) = 3
    assert coefficients("bcast", 1) == (1.0, 1.0)  # at least one latency
    assert coefficients("all_gather", 1) == (1.0, 0.0)
    with pytest.raises(mcrdl.InvalidArgumentError, match="no alpha-beta model"):
        coefficients("frobnicate", 4)
    with pytest.raises(mcrdl.InvalidArgumentError, match="group size"):
        coefficients("all_reduce", 0)
    assert AlphaBeta(1e-6, 1e-9).predict(4, 1000) == pytest.approx(2e-6)  # Hockney default


def _synthetic(op, alpha, beta, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    m = AlphaBeta(alpha, beta, op)
    return [(g, n, m.predict(g, n) * (1 + noise * rng.uniform(-1, 1)))
            for g in (2, 3, 4, 8) for n in [8 << (2 * k) for k in range(13)]]  # 8 B .. 128 MiB


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "bcast", "gatherv", "send"])
def test_fit_recovers_alpha_beta(op):
    exact = fit(op, _synthetic(op, 3e-6, 1.5e-10))
    assert exact.op == op
    assert rel(exact.alpha, 3e-6) < 1e-9 and rel(exact.beta, 1.5e-10) < 1e-9
    noisy = fit(op, _synthetic(op, 3e-6, 1.5e-10, noise=0.05, seed=1))
    assert rel(noisy.alpha, 3e-6) < 0.05 and rel(noisy.beta, 1.5e-10) < 0.05


def test_fit_barrier_has_no_bandwidth_term():
    m = fit("barrier", [(g, 0, 2e-6 * coefficients("barrier", g)[0]) for g in (2, 4, 8)])
    assert rel(m.alpha, 2e-6) < 1e-9 and m.beta == 0.0


def test_fit_is_non_negative():
    # times falling with size: unconstrained least squares wants beta < 0
    samples = [(2, 8, 5e-6), (2, 1_000_000, 4e-6), (2, 2_000_000, 3e-6)]
    m = fit("send", samples)
    assert m.beta == 0.0
    inv = [1 / t for _, _, t in samples]  # argmin sum (alpha / t - 1)^2
    assert rel(m.alpha, sum(inv) / sum(x * x for x in inv)) < 1e-9
    # pure bandwidth data: alpha = 0, beta exact
    m = fit("send", [(2, n, 1e-9 * n) for n in (8, 64, 512)])
    assert m.alpha == 0.0 and rel(m.beta, 1e-9) < 1e-9
    assert fit("send", [(2, 8, 0.0)]) == AlphaBeta(0.0, 0.0, "send")


@pytest.mark.parametrize("bad", [[(2, 8, -1e-6)], [(2, 8, math.nan)], [(0, 8, 1e-6)],
                                 [(2, -8, 1e-6)], [(2, 8)], [(2, 8.5, 1e-6)]])
def test_fit_rejects_bad_samples(bad):
    with pytest.raises(mcrdl.InvalidArgumentError, match="sample 0"):
        fit("all_reduce", bad)


def test_holdout_error():
    samples = _synthetic("all_gather", 3e-6, 1.5e-10)
    held = [s for s in samples if s[1] == 8 << 8]
    res = holdout_error("all_gather", samples, held)
    assert res["n"] == len(held) == 4
    assert res["median_rel_err"] < 1e-9 and res["max_rel_err"] < 1e-9
    res = holdout_error("all_gather", samples, lambda g, n, t: g == 8)  # a held-out scale
    assert res["n"] == 13 and res["max_rel_err"] < 1e-9
    # one held-out point measured 1.5x slower than the model: error 0.5 / 1.5 = 1/3
    g, n, t = held[0]
    res = holdout_error("all_gather", samples, [(g, n, 1.5 * t)])
    assert res["n"] == 1 and res["max_rel_err"] == pytest.approx(1 / 3)
    assert res["median_rel_err"] == pytest.approx(1 / 3)
    assert rel(res["alpha"], 3e-6) < 1e-9
    with pytest.raises(mcrdl.InvalidArgumentError, match="held out"):
        holdout_error("all_gather", samples, lambda g, n, t: True)
    assert math.isnan(holdout_error("all_gather", samples, [])["median_rel_err"])


def test_table_model_matches_model_fit():
    t = model_table({"mpi": (2e-6, 4e-10)}, op="reduce_scatter", group_sizes=(2, 4, 8))
    samples = t.samples("reduce_scatter", "mpi")
    assert len(samples) == 3 * len(POW2)
    assert t.model("reduce_scatter", "mpi") == mdl.fit("reduce_scatter", samples)
    assert t.model("reduce_scatter", "gloo") is None


def test_suspicious_points_are_isolated_flips_and_close_calls():
    from mcrdl.tools.tuning_suite import suspicious_points

    t = TuningTable({})
    sizes = [8, 64, 512, 4096, 32768]
    mpi = [1.0, 2.0, 3.0, 4.0, 5.0]
    gloo = [10.0, 20.0, 2.0, 40.0, 5.5]  # 512 B: an isolated gloo win; 32 KiB: within 10%
    for n, a, b in zip(sizes, mpi, gloo, strict=True):
        t.add("all_gather", 8, "mpi", n, a)
        t.add("all_gather", 8, "gloo", n, b)
    t.add("bcast", 8, "mpi", 8, 1.0)  # one backend only: nothing to confirm
    assert suspicious_points(t, ["mpi", "gloo"], 1.25) == [
        ("all_gather", 8, 512), ("all_gather", 8, 32768)]
    assert suspicious_points(t, ["mpi", "gloo"], 1.05) == [("all_gather", 8, 512)]
    # a run of two gloo wins is a regime, not a flip
    t.add("all_gather", 8, "gloo", 4096, 3.0)
    assert suspicious_points(t, ["mpi", "gloo"], 1.05) == []
    assert suspicious_points(t, ["mpi"], 1.25) == []


# -- MPI blocking variants -----------------------------------------------------------


def _power_law(x: int, c: float, k: float) -> float:
    return c * x ** k


def test_variants_round_trip_and_backend_time_is_the_faster(tmp_path):
    t = TuningTable(PROV)
    # blocking ~ x, nonblocking ~ sqrt(x) * sqrt(2048): they cross at exactly 2048 B
    sizes = [64, 256, 1024, 4096, 16384]
    for n in sizes:
        t.add_variant("all_reduce", 2, "mpi", n, "blocking", _power_law(n, 1e-9, 1.0))
        t.add_variant("all_reduce", 2, "mpi", n, "nonblocking",
                      _power_law(n, 1e-9 * math.sqrt(2048), 0.5))
        t.add("all_reduce", 2, "gloo", n, 1e-3)
    t.add_variant("barrier", 2, "mpi", 0, "blocking", 3e-6)
    t.add_variant("barrier", 2, "mpi", 0, "nonblocking", 2e-6)
    for n in sizes:
        b, nb = (t.variant_times("all_reduce", 2, "mpi")[v][n] for v in schema.VARIANTS[:2])
        assert t.times("all_reduce", 2, "mpi")[n] == min(b, nb)
    steps = t.blocking_steps("all_reduce", 2, "mpi")
    assert [v for _, v in steps] == [True, False] and steps[1][0] == -1
    assert 2047 <= steps[0][0] <= 2048  # where the log-log interpolations cross
    assert t.blocking_steps("barrier", 2, "mpi") == [(-1, False)]
    assert t.blocking_steps("all_reduce", 2, "gloo") is None
    assert t.blocking_table("mpi") == {"all_reduce": {2: steps}, "barrier": {2: [(-1, False)]}}
    assert t.blocking_table("gloo") == {}
    path = tmp_path / "v.json"
    t.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == VERSION == 4
    entry = doc["ops"]["all_reduce"]["2"]
    assert entry["blocking"] == {"mpi": [list(s) for s in steps]}
    assert entry["variants"]["mpi"]["blocking"] == [_power_law(n, 1e-9, 1.0) for n in sizes]
    assert "variants" not in doc["ops"]["all_reduce"]["2"]["times"]
    back = TuningTable.load(path)
    assert back == t
    assert back.blocking_table("mpi") == t.blocking_table("mpi")
    assert back.has_variant("all_reduce", 2, "mpi", 64, "nonblocking")
    assert not back.has_variant("all_reduce", 2, "mpi", 8, "nonblocking")


def test_derive_steps_crossover_at_zero_bytes_is_linear_and_ties_stay_nonblocking():
    # linear segment from 0 B: blocking 1 -> 3, nonblocking 2 -> 2 over [0, 100]: cross at 50
    steps = tbl.derive_steps({"blocking": {0: 1.0, 100: 3.0}, "nonblocking": {0: 2.0, 100: 2.0}})
    assert steps == [(50, True), (-1, False)]
    assert tbl.derive_steps({"blocking": {8: 1.0}, "nonblocking": {8: 1.0}}) == [(-1, False)]
    assert tbl.derive_steps({"blocking": {8: 1.0}, "nonblocking": {16: 1.0}}) is None
    # runs merge; an isolated flip is a step of its own
    steps = tbl.derive_steps({"blocking": {8: 1, 16: 1, 32: 3, 64: 1},
                              "nonblocking": {8: 2, 16: 2, 32: 2, 64: 2}})
    assert [v for _, v in steps] == [True, False, True]
    assert 16 <= steps[0][0] < 32 and 32 <= steps[1][0] < 64 and steps[2][0] == -1


def test_allreduce_variant_derives_round_trips_and_is_checked_per_op(tmp_path):
    """all_gather / reduce_scatter have a third variant, "allreduce": the fastest of the
    three wins each size, steps end where the two winners' curves cross, and only those
    ops may hold it (times or steps); a version 2 file may not."""
    steps = tbl.derive_steps({"blocking": {8: 2, 512: 2, 4096: 2, 65536: 10},
                              "nonblocking": {8: 3, 512: 3, 4096: 3, 65536: 5},
                              "allreduce": {8: 1, 512: 1, 4096: 4, 65536: 40}})
    assert [v for _, v in steps] == ["allreduce", True, False]
    assert 512 <= steps[0][0] < 4096 and 4096 <= steps[1][0] < 65536 and steps[2][0] == -1
    # a tie keeps the earlier of nonblocking, blocking, allreduce
    assert tbl.derive_steps({"blocking": {8: 1}, "nonblocking": {8: 2},
                             "allreduce": {8: 1}}) == [(-1, True)]
    # the earlier winner missing at the next size (an interrupted run): the step ends at
    # the last size it won
    assert tbl.derive_steps({"blocking": {8: 2, 64: 2, 512: 1}, "nonblocking": {8: 3, 64: 3,
                             512: 3}, "allreduce": {8: 1}}) == [(8, "allreduce"), (-1, True)]
    # allreduce missing at the size below: its step starts there
    assert tbl.derive_steps({"blocking": {8: 2, 64: 2}, "nonblocking": {8: 3, 64: 3},
                             "allreduce": {64: 1}}) == [(8, True), (-1, "allreduce")]
    t = TuningTable(PROV)
    for n, (b, nb, ar) in {8: (2e-6, 3e-6, 1e-6), 4096: (2e-6, 3e-6, 4e-6)}.items():
        for v, sec in zip(("blocking", "nonblocking", "allreduce"), (b, nb, ar), strict=True):
            t.add_variant("all_gather", 2, "mpi", n, v, sec)
    assert t.times("all_gather", 2, "mpi") == {8: 1e-6, 4096: 2e-6}
    steps = t.blocking_steps("all_gather", 2, "mpi")
    assert [v for _, v in steps] == ["allreduce", True]
    path = tmp_path / "ar.json"
    t.save(path)
    doc = json.loads(path.read_text())
    entry = doc["ops"]["all_gather"]["2"]
    assert entry["variants"]["mpi"]["allreduce"] == [1e-6, 4e-6]
    assert entry["blocking"]["mpi"][0][1] == "allreduce"
    assert TuningTable.load(path) == t
    with pytest.raises(TuningTableError, match="variant must be one of blocking, nonblocking "
                                               "for bcast"):
        t.add_variant("bcast", 2, "mpi", 8, "allreduce", 1e-6)
    with pytest.raises(TuningTableError, match="an integer and a boolean"):
        t.set_blocking_steps("bcast", 2, "mpi", [[64, "allreduce"], [-1, False]])
    t.set_blocking_steps("reduce_scatter", 2, "mpi", [[64, "allreduce"], [-1, False]])
    bad = copy.deepcopy(doc)
    bad["ops"]["all_gather"]["2"]["blocking"]["mpi"][0][1] = "fast"
    with pytest.raises(TuningTableError, match=r'blocking\["mpi"\]\[0\].*or "allreduce"'):
        TuningTable.from_dict(bad)
    old = copy.deepcopy(doc)
    old["version"] = 2
    with pytest.raises(TuningTableError, match="unknown key 'allreduce'"):
        TuningTable.from_dict(old)
    del old["ops"]["all_gather"]["2"]["variants"]
    with pytest.raises(TuningTableError, match="an integer and a boolean, got"):
        TuningTable.from_dict(old)


def test_hand_set_steps_hold_until_variants_are_measured_again():
    t = TuningTable(PROV)
    t.add_variant("bcast", 2, "mpi", 8, "blocking", 1e-6)
    t.add_variant("bcast", 2, "mpi", 8, "nonblocking", 2e-6)
    t.set_blocking_steps("bcast", 2, "mpi", [[4096, True], [-1, False]])
    assert t.blocking_steps("bcast", 2, "mpi") == [(4096, True), (-1, False)]
    again = TuningTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.blocking_steps("bcast", 2, "mpi") == [(4096, True), (-1, False)]
    again.add_variant("bcast", 2, "mpi", 8, "blocking", 1e-6)  # a new measurement
    assert again.blocking_steps("bcast", 2, "mpi") == [(-1, True)]
    with pytest.raises(TuningTableError, match="increasing order"):
        t.set_blocking_steps("bcast", 2, "mpi", [[64, True], [8, False]])
    with pytest.raises(TuningTableError, match="variant must be one of blocking, nonblocking"):
        t.add_variant("bcast", 2, "mpi", 8, "fast", 1e-6)
    with pytest.raises(TuningTableError, match="seconds must be"):
        t.add_variant("bcast", 2, "mpi", 8, "blocking", -1.0)


def test_version_1_table_loads_and_the_mpi_backend_keeps_the_shipped_steps(tmp_path):
    from mcrdl.backends import mpi

    old = {"schema": SCHEMA, "version": 1, "provenance": {"host": "old"},
           "ops": {"all_reduce": {"2": {"sizes": [8, 1024],
                                        "times": {"mpi": [1e-6, 3e-6], "gloo": [2e-5, 3e-5]},
                                        "winners": [[8, "mpi"]]}}}}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    t = TuningTable.load(path)
    assert t.times("all_reduce", 2, "mpi") == {8: 1e-6, 1024: 3e-6}
    assert t.blocking_table("mpi") == {}
    for op in mpi.BLOCKING_OPS:
        assert (mpi.blocking_steps(op, 2, "auto", t.blocking_table("mpi"))
                == mpi.shipped_blocking()[op][2])
    t.save(path)  # written again: the current version, same points
    assert json.loads(path.read_text())["version"] == VERSION
    assert TuningTable.load(path) == t


def test_confirmed_points_round_trip_and_older_versions_have_none(tmp_path, capsys):
    """Version 4 records the points the confirmation pass re-measured (per entry, sizes
    of that entry); a point of a size the entry lacks is not written; older versions
    read as having none."""
    t = TuningTable.from_dict(valid_doc())
    t.mark_confirmed("all_reduce", 4, 16)
    t.mark_confirmed("all_reduce", 4, 999)  # not a measured size: not written
    path = tmp_path / "c.json"
    t.save(path)
    doc = json.loads(path.read_text())
    assert doc["ops"]["all_reduce"]["4"]["confirmed"] == [16]
    back = TuningTable.load(path)
    assert back.is_confirmed("all_reduce", 4, 16) and not back.is_confirmed("all_reduce", 4, 8)
    assert not back.is_confirmed("all_reduce", 4, 999) and back != t
    old = valid_doc()
    old["version"] = 3
    assert not any(TuningTable.from_dict(old).is_confirmed("all_reduce", 4, n)
                   for n in (8, 16, 32))
    assert "confirmed" not in valid_doc()["ops"]["all_reduce"]["4"]  # none: no key
    from mcrdl.tools.tune import main as tune_main
    assert tune_main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    rows = {line.split()[0]: line for line in shown.splitlines() if line.startswith("  ")
            and line.split()[0][0].isdigit()}
    assert rows["16*"] and "8" in rows and "32" in rows, shown
    assert "*: re-measured by the confirmation pass" in shown, shown


def test_newer_version_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps({**valid_doc(), "version": VERSION + 1}))
    with pytest.raises(TuningTableError) as info:
        TuningTable.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: $.version: expected 1, 2, 3 or 4"), msg
    assert "upgrade mcrdl" in msg and "re-run mcrdl-tune run" in msg, msg


def test_table_steps_override_the_shipped_ones_per_op():
    from mcrdl.backends import mpi

    t = TuningTable(PROV)
    t.set_blocking_steps("all_reduce", 2, "mpi", [(4096, True), (-1, False)])
    table = t.blocking_table("mpi")
    assert mpi.blocking_steps("all_reduce", 2, "auto", table) == [(4096, True), (-1, False)]
    assert mpi.blocking_steps("all_reduce", 3, "auto", table) == [(4096, True), (-1, False)]
    assert mpi.blocking_steps("bcast", 2, "auto", table) == mpi.shipped_blocking()["bcast"][2]
    assert mpi.blocking_steps("all_reduce", 2, "never", table) == [(-1, False)]
    assert t.blocking_table("cray-mpich") == {}
    # steps of an op without a blocking MPI variant (hand-made): refused at init, not ignored
    t.set_blocking_steps("all_to_all", 2, "mpi", [(-1, True)])
    # what the check reads: whose steps, and whether the table's MPI init matches this one
    backend = types.SimpleNamespace(blocking_source="mpi", _table_init_matches=lambda t: True)
    with pytest.raises(TuningTableError, match=r"steps for \['all_to_all'\].*remove them"):
        mpi.MPIBackend.use_tuning_table(backend, t)


def test_readme_example_steps_are_the_derived_ones():
    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), re.S)
    t = TuningTable.from_dict(json.loads(blocks[0]), source="README.md")
    steps = t.blocking_steps("all_reduce", 4, "mpi")
    assert steps == tbl.derive_steps(t.variant_times("all_reduce", 4, "mpi")) == [(15, True),
                                                                                   (-1, False)]
    assert f"up to {steps[0][0]} B" in README.read_text()


def test_suspicious_points_include_isolated_variant_flips():
    from mcrdl.tools.tuning_suite import suspicious_points

    t = TuningTable(PROV)
    sizes = [8 ** k for k in range(1, 8)]
    for n in sizes:
        # blocking faster except at 512 (isolated) and from 256 KiB on (a regime change)
        b = 3e-6 if n == 512 or n >= 1 << 18 else 1e-6
        t.add_variant("all_reduce", 2, "mpi", n, "blocking", b)
        t.add_variant("all_reduce", 2, "mpi", n, "nonblocking", 2e-6)
    assert suspicious_points(t, ["mpi"], 1.25) == [("all_reduce", 2, 512)]
    for n in sizes:  # a second backend far behind: no backend flips, still the variant one
        t.add("all_reduce", 2, "gloo", n, 1e-3)
    assert suspicious_points(t, ["mpi", "gloo"], 1.25) == [("all_reduce", 2, 512)]
    # three variants (all_gather): allreduce wins but at 512, where blocking does
    t3 = TuningTable(PROV)
    for n in sizes:
        t3.add_variant("all_gather", 2, "mpi", n, "blocking", 2e-6)
        t3.add_variant("all_gather", 2, "mpi", n, "nonblocking", 3e-6)
        t3.add_variant("all_gather", 2, "mpi", n, "allreduce", 4e-6 if n == 512 else 1e-6)
    assert suspicious_points(t3, ["mpi"], 1.25) == [("all_gather", 2, 512)]


def test_table_routes_each_payload_among_the_backends_of_its_device():
    """With a table over a CPU and a GPU backend, a CPU tensor goes to the fastest CPU
    backend and a GPU one to the fastest GPU backend, whatever the table says of the
    other device's (a 1 MiB CPU tensor went to nccl, which refuses it)."""
    import torch

    from mcrdl.extensions import auto
    from mcrdl.ops import OPS, ReduceOp

    class Chain:  # stands in for a backend's layers: each op returns the backend's name
        def __init__(self, name):
            self.name = name

        def __getattr__(self, op):
            if op in OPS:
                return lambda *args: self.name
            raise AttributeError(op)

    class OnGpu:  # a payload on a GPU, as far as routing looks (is_cuda and size)
        is_cuda = True

        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    t = TuningTable()
    for n, t_mpi, t_nccl in ((8, 3e-6, 2e-5), (1 << 20, 4e-4, 6e-5)):
        t.add("all_reduce", 2, "mpi", n, t_mpi)
        t.add("all_reduce", 2, "nccl", n, t_nccl)
    chains = {"mpi": Chain("mpi"), "nccl": Chain("nccl")}
    router = auto.build(chains, t, 2, {"mpi": frozenset({"cpu"}), "nccl": frozenset({"cuda"})})
    for n in (2, 1 << 18):  # 8 B and 1 MiB
        assert router.all_reduce(torch.zeros(n), ReduceOp.SUM, None, False) == "mpi"
        assert router.all_reduce(OnGpu(n), ReduceOp.SUM, None, False) == "nccl"
    # one device's backends only: the table as before
    cpu_only = auto.build({"mpi": Chain("mpi"), "gloo": Chain("gloo")}, t, 2, {})
    assert cpu_only.all_reduce(torch.zeros(2), ReduceOp.SUM, None, False) == "mpi"
    # debug mode: by group size alone, so that ranks disagreeing on a call's size still
    # meet on one backend, whose check then raises DesyncError (not a timeout on each)
    t2 = TuningTable()
    for n, t_mpi, t_gloo in ((8, 1e-6, 2e-6), (1 << 20, 4e-4, 1e-4)):
        t2.add("all_reduce", 2, "mpi", n, t_mpi)
        t2.add("all_reduce", 2, "gloo", n, t_gloo)
    chains = {"mpi": Chain("mpi"), "gloo": Chain("gloo")}
    normal, debug = auto.build(chains, t2, 2, {}), auto.build(chains, t2, 2, {}, debug=True)
    sizes = (torch.zeros(2), torch.zeros(1 << 18))
    assert [normal.all_reduce(x, ReduceOp.SUM, None, False) for x in sizes] == ["mpi", "gloo"]
    assert {debug.all_reduce(x, ReduceOp.SUM, None, False) for x in sizes} == {"gloo"}
    # a receive goes where its send goes, or the two never meet: by send's data, when
    # the table has none of recv's or other winners for it
    t3 = TuningTable()
    for n, t_mpi, t_gloo in ((8, 1e-6, 2e-6), (1 << 20, 4e-4, 1e-4)):
        t3.add("send", 2, "mpi", n, t_mpi)
        t3.add("send", 2, "gloo", n, t_gloo)
    t3.add("recv", 2, "mpi", 1 << 20, 1e-5)  # recv's own data would pick mpi at 1 MiB
    p2p = auto.build(chains, t3, 2, {})
    for x, want in zip(sizes, ("mpi", "gloo"), strict=True):
        assert (p2p.send(x, 1, 0, None, False), p2p.recv(x, 0, 0, None, False)) == (want, want)


@pytest.mark.parametrize("command", ["show", "model", "plot"])
def test_reading_commands_refuse_a_bad_table_in_one_line(command, tmp_path, capsys):
    """mcrdl-tune show/model/plot of a table that cannot be read: the loader's message on
    one line and exit 2, not a traceback."""
    from mcrdl.tools.tune import main as tune_main

    missing = tmp_path / "none.json"
    extra = ["--out-dir", str(tmp_path / "png")] if command == "plot" else []
    with pytest.raises(SystemExit) as e:
        tune_main([command, str(missing), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mcrdl-tune {command}: error: {missing}: no such tuning table"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
