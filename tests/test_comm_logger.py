"""Communication logging: summary, exports and Chrome traces.

Single-process checks of the formulas and the trace format, then real multi-rank runs:
tests/fusion/logger_ranks.py (exact counts and bytes, straggler view, exports, wire
level) and examples/listing4_traced.py, whose trace must show an mpi and a gloo call
overlapping in time on every rank."""

import json
import math
import os
import sys

import pytest

import mcrdl
from mcrdl.extensions import comm_logger, comm_report
from mcrdl.extensions.comm_logger import bucket_of
from mcrdl.ops import OPS

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def launch(n, script, *args, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(REPO))
    return run_launcher([mpiexec_or_skip(), "-n", str(n), sys.executable, script,
                         *map(str, args)], env=env, timeout=timeout)


def check_chrome_trace(doc: dict) -> dict[int, dict[int, str]]:
    """Assert `doc` is a Chrome trace as mcrdl writes it; returns {pid: {tid: lane}}."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    lanes: dict[int, dict[int, str]] = {}
    processes, spans = set(), {}
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and e.get("ph") in ("X", "M"), e
        assert isinstance(e.get("name"), str) and e["name"], e
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, e
        assert isinstance(e.get("args"), dict), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index"), e
            if e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str)
                lanes.setdefault(e["pid"], {})[e["tid"]] = e["args"]["name"]
            elif e["name"] == "process_name":
                processes.add(e["pid"])
            continue
        for key in ("ts", "dur"):
            value = e.get(key)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), e
            assert math.isfinite(value) and value >= 0, e
        assert isinstance(e.get("cat"), str), e
        assert {"backend", "bytes", "group_size", "async", "level"} <= set(e["args"]), e
        spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for (pid, tid), items in spans.items():
        assert pid in processes and tid in lanes.get(pid, {}), (pid, tid)
        items.sort()
        for (_, end), (start, _) in zip(items, items[1:], strict=False):
            assert start >= end - 1e-3, f"events overlap on one lane {pid}/{tid}"
    return lanes


def overlapping(doc: dict, pid: int, a: str, b: str) -> bool:
    """Whether some event on a lane of backend `a` overlaps one of backend `b` in `pid`."""
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "thread_name"}
    events = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
    xs = [e for e in events if lanes[(pid, e["tid"])].split()[0] == a]
    ys = [e for e in events if lanes[(pid, e["tid"])].split()[0] == b]
    return any(x["ts"] < y["ts"] + y["dur"] and y["ts"] < x["ts"] + x["dur"]
               for x in xs for y in ys)


def test_buckets_and_bus_bandwidth_factors():
    assert [bucket_of(n) for n in (0, 1, 3, 1024, 1500, 4096)] == [0, 1, 2, 1024, 1024, 4096]
    factor = {op: spec.bus_factor for op, spec in OPS.items()}
    assert factor["all_reduce"](4) == 1.5 and factor["all_gather"](4) == 0.75
    assert factor["bcast"](8) == factor["send"](2) == 1.0
    assert factor["gather"](4) == factor["all_to_all_single"](4) == 0.75


def test_summary_and_trace_of_records(tmp_path, capsys):
    """Records made by hand (no backend needed): rows, table, exports, trace schema."""
    log = comm_logger.logger()
    log.reset()
    t0 = 1_000_000
    recs = [log.start("call", "all_reduce", "mpi", None, 4, 1024, t0, True),
            log.start("call", "all_reduce", "mpi", None, 4, 1500, t0 + 500, True),
            log.start("call", "all_gather", "gloo", None, 4, 4096, t0 + 700, False)]
    for k, rec in enumerate(recs):
        log.finish(rec, rec.t0 + 1000 * (k + 1))
    pending = log.start("call", "bcast", "mpi", None, 4, 8, t0, True)  # never completed
    rows = mcrdl.log_summary()
    assert "all_reduce" in capsys.readouterr().out
    by_op = {(r["op"], r["bucket_bytes"]): r for r in rows}
    ar = by_op[("all_reduce", 1024)]
    assert (ar["count"], ar["bytes"], ar["completed"]) == (2, 2524, 2)
    assert (ar["lat_min_us"], ar["lat_median_us"], ar["lat_max_us"]) == (1.0, 1.5, 2.0)
    assert ar["algbw_GBps"] == pytest.approx(1262 / 1.5e-6 / 1e9)
    assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"] * 1.5)
    assert by_op[("bcast", 8)]["completed"] == 0 and by_op[("bcast", 8)]["lat_min_us"] is None
    csv_path = mcrdl.export_log(tmp_path / "log.csv")
    lines = open(csv_path, encoding="utf-8").read().splitlines()
    assert lines[0].startswith("level,op,backend,bucket_bytes") and len(lines) == 1 + len(rows)
    doc = json.load(open(mcrdl.export_log(tmp_path / "log.json"), encoding="utf-8"))
    assert doc["rows"] == json.loads(json.dumps(rows))
    trace = json.load(open(mcrdl.export_trace(tmp_path / "t{rank}.json"), encoding="utf-8"))
    lanes = check_chrome_trace(trace)
    assert sorted(lanes[0].values()) == ["gloo", "mpi", "mpi #2"]  # overlapping mpi calls
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 3  # not the pending one
    with pytest.raises(mcrdl.InvalidArgumentError, match="format"):
        mcrdl.export_log(tmp_path / "x.txt", format="xml")
    with pytest.raises(mcrdl.BackendUnavailableError, match="gather=True"):
        mcrdl.log_summary(gather=True)
    log.finish(pending, pending.t0 + 10)
    log.reset()
    assert mcrdl.log_summary(quiet=True) == []


def test_arrivals_index_collectives_only_and_level_is_checked():
    """Collectives are matched across ranks by their issue index on (level, backend,
    group): point-to-point calls, as many on a rank as it sends or receives, must not
    shift it (a root that sent twice had its all_reduces compared with the others'
    earlier ones). A level other than call/wire is an error, not an empty table."""
    log = comm_logger.logger()
    log.reset()
    for op in ("send", "send", "all_reduce", "recv", "all_reduce"):
        log.finish(log.start("call", op, "mpi", None, 3, 64, 1000, False), 2000)
    assert [i for i, _, _ in log.arrivals[("call", "mpi", 0, "all_reduce", 3)]] == [1, 2]
    log.reset()
    with pytest.raises(mcrdl.InvalidArgumentError, match="'level' is 'calls'"):
        mcrdl.log_summary(level="calls")
    with pytest.raises(mcrdl.InvalidArgumentError, match="'level'"):
        mcrdl.export_log("x.json", level="Call")


def test_extension_blocks_of_two_threads_leave_their_own_settings():
    """A thread leaving its extensions() block removes its own settings, not those of a
    block another thread entered after it."""
    import threading

    from mcrdl.extensions import current
    entered, leave = threading.Event(), threading.Event()

    def other():
        with mcrdl.extensions(logging=True):
            entered.set()
            leave.wait(10)

    with mcrdl.extensions(fusion=True):
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
    assert current().logging is not None, current()  # the other block's, still in force
    leave.set()
    thread.join(10)
    assert current().fusion is None and current().logging is None, current()


def test_logging_counts_stragglers_exports_on_three_ranks(tmp_path):
    out = launch(3, os.path.join(TESTS, "fusion", "logger_ranks.py"), tmp_path)
    assert "logger OK" in out, out
    with open(tmp_path / "trace.json", encoding="utf-8") as f:
        doc = json.load(f)
    lanes = check_chrome_trace(doc)
    assert sorted(lanes) == [0, 1, 2]
    assert any("wire" in name for name in lanes[0].values())  # the fused calls' lane


def test_listing4_trace_shows_two_backends_overlapping(tmp_path):
    path = tmp_path / "listing4.json"
    out = launch(3, os.path.join(REPO, "examples", "listing4_traced.py"), path)
    assert "wrote the trace of 3 ranks" in out, out
    for r in range(3):
        assert f"rank {r}: listing 4 traced, results correct" in out
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    lanes = check_chrome_trace(doc)
    for pid in range(3):
        assert {"mpi", "gloo"} <= {name.split()[0] for name in lanes[pid].values()}
        assert overlapping(doc, pid, "mpi", "gloo"), f"rank {pid}: no mpi/gloo overlap"
    print(out)


def test_long_runs_keep_a_bounded_log(monkeypatch):
    """Past MAX_SAMPLES a row keeps a uniform sample of its latencies (count, min, max
    exact) and a collective row every stride-th arrival by issue index: two ranks that
    made the same calls keep the same ones, so the skew still matches them."""
    monkeypatch.setattr(comm_logger, "MAX_SAMPLES", 64)
    views = []
    for rank in (0, 1):
        log = comm_logger.logger()
        log.reset()
        log.rank = rank
        for i in range(1000):
            t0 = 10_000 * i + 7 * rank  # rank 1 issues 7 ns later, every call
            log.finish(log.start("call", "all_reduce", "mpi", None, 2, 64, t0, False),
                       t0 + 1000 + i)  # latencies 1000 .. 1999 ns
        row = log.rows[("call", "all_reduce", "mpi", 64, 2)]
        kept = log.arrivals[("call", "mpi", 0, "all_reduce", 2)]
        assert len(row.lat_ns) == 64 and row.completed == 1000
        assert 1000 <= min(row.lat_ns) and max(row.lat_ns) <= 1999
        assert 32 <= len(kept) <= 64 and all(s % 16 == 0 for s, _, _ in kept)
        views.append(log.local_view())
    log.reset()
    rows = comm_report._rows_from(views, "call")
    comm_report._arrival_skew(views, rows)
    (r,) = rows
    assert (r["count"], r["completed"]) == (2000, 2000)
    assert (r["lat_min_us"], r["lat_max_us"]) == (1.0, 1.999)
    assert 1.3 < r["lat_median_us"] < 1.7  # the sample's median, true median 1.4995
    assert r["arrival_skew_median_us"] == pytest.approx(0.007)
    assert r["last_arrival_rank"] == 1
