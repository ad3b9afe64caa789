"""The reports of the communication log (comm_logger.py records the calls): the summary
table, its export, and a timeline.

- :func:`summary` / ``mcrdl.log_summary``: counts, bytes and latency min/median/max per
  (level, op, backend, size bucket, group size), with algbw/busbw as nccl-tests defines
  them (``algbw = bytes / time`` with the mean bytes of the row and its median latency,
  ``busbw = algbw x factor``: ``2(n-1)/n`` all_reduce; ``(n-1)/n`` all_gather(v),
  reduce_scatter, all_to_all*, gather(v), scatter(v); ``1`` bcast, reduce, send,
  recv). With ``gather=True`` (collective) the rows pool every rank and add the
  straggler view: the spread of the ranks' median latencies (max - min), and the
  arrival skew of each collective (latest minus earliest issue time over the ranks;
  the rank most often last is the straggler).
- :func:`export_log`: the summary rows as JSON or CSV.
- :func:`export_trace`: a Chrome trace (``traceEvents``, "X" complete events, ``pid`` =
  rank, ``tid`` = backend lane) that Perfetto and chrome://tracing open. Async calls of
  one backend that overlap in time go to sub-lanes (``mpi``, ``mpi #2``, ...), so that
  events of one lane never overlap.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys

from ..errors import BackendUnavailableError, InvalidArgumentError
from ..ops import OPS
from .comm_logger import CommLogger, logger

ROW_FIELDS = ("level", "op", "backend", "bucket_bytes", "bucket", "group_size", "count",
              "bytes", "completed", "lat_min_us", "lat_median_us", "lat_max_us",
              "algbw_GBps", "busbw_GBps")
STRAGGLER_FIELDS = ("ranks", "lat_median_spread_us", "slowest_rank", "fastest_rank",
                    "arrival_skew_median_us", "arrival_skew_max_us", "last_arrival_rank")



def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _rows_from(views: list[dict], level: str | None) -> list[dict]:
    merged: dict[tuple, list] = {}
    per_rank: dict[tuple, dict[int, list[int]]] = {}
    for view in views:
        for key, (count, nbytes, lats, completed, lo, hi) in view["rows"].items():
            if level is not None and key[0] != level:
                continue
            m = merged.setdefault(key, [0, 0, [], 0, None, None])
            m[0] += count
            m[1] += nbytes
            m[2].extend(lats)
            if completed:
                m[3] += completed
                m[4] = lo if m[4] is None else min(m[4], lo)
                m[5] = hi if m[5] is None else max(m[5], hi)
            per_rank.setdefault(key, {})[view["rank"]] = lats
    rows = []
    for key in sorted(merged, key=lambda k: (k[0], k[1], k[2], k[4], k[3])):
        lvl, op, backend, bucket, gsize = key
        count, nbytes, lats, completed, lo, hi = merged[key]
        row = {"level": lvl, "op": op, "backend": backend, "bucket_bytes": bucket,
               "bucket": format_bytes(bucket), "group_size": gsize, "count": count,
               "bytes": nbytes, "completed": completed}
        if lats:
            med = statistics.median(lats) / 1000.0
            row.update(lat_min_us=lo / 1000.0, lat_median_us=med, lat_max_us=hi / 1000.0)
            algbw = (nbytes / count) / (med * 1e-6) / 1e9 if med > 0 else 0.0
            row.update(algbw_GBps=algbw, busbw_GBps=algbw * OPS[op].bus_factor(gsize))
        else:
            row.update(lat_min_us=None, lat_median_us=None, lat_max_us=None, algbw_GBps=None,
                       busbw_GBps=None)
        if len(views) > 1:
            medians = {r: statistics.median(v) / 1000.0 for r, v in per_rank[key].items() if v}
            row["ranks"] = len(per_rank[key])
            if medians:
                row["lat_median_spread_us"] = max(medians.values()) - min(medians.values())
                row["slowest_rank"] = max(medians, key=medians.get)
                row["fastest_rank"] = min(medians, key=medians.get)
        rows.append(row)
    return rows


def _arrival_skew(views: list[dict], rows: list[dict]) -> None:
    """Add the arrival skew of each row's collectives (calls matched across ranks by
    their issue index on (level, backend, group))."""
    if len(views) < 2:
        return
    calls: dict[tuple, dict[int, dict[int, float]]] = {}
    buckets: dict[tuple, int] = {}  # the row of a call: its bucket on the lowest rank
    for view in sorted(views, key=lambda v: -v["rank"]):
        for key, arrivals in view["arrivals"].items():
            by_seq = calls.setdefault(key, {})
            for seq, t, bucket in arrivals:
                by_seq.setdefault(seq, {})[view["rank"]] = t
                buckets[(key, seq)] = bucket
    skews: dict[tuple, list[tuple[float, int]]] = {}
    for key, by_seq in calls.items():
        level, backend, _gid, op, gsize = key
        for seq, times in by_seq.items():
            if gsize < 2 or len(times) != gsize:  # not every member logged it
                continue
            last = max(times, key=times.get)
            skews.setdefault((level, op, backend, buckets[(key, seq)], gsize), []).append(
                ((max(times.values()) - min(times.values())) / 1000.0, last))
    for row in rows:
        s = skews.get((row["level"], row["op"], row["backend"], row["bucket_bytes"],
                       row["group_size"]))
        if s:
            values = [x for x, _ in s]
            lasts = [r for _, r in s]
            row["arrival_skew_median_us"] = statistics.median(values)
            row["arrival_skew_max_us"] = max(values)
            row["last_arrival_rank"] = max(set(lasts), key=lasts.count)


def _views(gather: bool) -> list[dict]:
    view = logger().local_view()
    return _allgather(view) if gather else [view]


def _allgather(obj: object) -> list:
    """Every rank's `obj` (collective over the world, on mcrdl's bootstrap channel)."""
    runtime = logger().runtime
    if runtime is None or not runtime.backends:
        raise BackendUnavailableError(
            "gather=True exchanges the logs of every rank and needs mcrdl initialized; call it "
            "on every rank before mcrdl.finalize(), or pass gather=False")
    return runtime.all_gather_object(obj)


def summary(*, gather: bool = False, level: str | None = "call", file=None,
            quiet: bool = False) -> list[dict]:
    """The logged calls as rows (dicts with ROW_FIELDS, plus STRAGGLER_FIELDS when
    gathered) per (level, op, backend, size bucket, group size), also printed as a table
    to `file` (default stdout) unless `quiet`; with gather=True only rank 0 prints.

    ``gather=True`` is collective: every rank must call it (mcrdl initialized); rows then
    pool all ranks (count and bytes summed) and add the straggler view. ``level``:
    "call" (what the program called), "wire" (what went to the backends), None (both).
    """
    if level not in (None, "call", "wire"):
        raise InvalidArgumentError(f"log_summary: 'level' is {level!r}; expected 'call', "
                                   "'wire' or None (both)")
    views = _views(gather)
    rows = _rows_from(views, level)
    _arrival_skew(views, rows)
    if not quiet and (not gather or logger().rank == 0):
        print(format_table(rows, gathered=len(views) > 1, ranks=len(views)),
              file=sys.stdout if file is None else file)
    return rows


def format_table(rows: list[dict], gathered: bool = False, ranks: int = 1) -> str:
    """The rows as the text table :func:`summary` prints."""
    def num(v, width: int, digits: int = 1) -> str:  # "-" where there is no value
        return "-".rjust(width) if v is None else f"{v:{width}.{digits}f}"

    who = f"all {ranks} ranks" if gathered else f"rank {logger().rank}"
    lines = [f"# mcrdl communication log ({who}; the latency of an async call ends when its "
             "Work was seen complete)"]
    head = (f"{'level':<5} {'op':<18} {'backend':<8} {'size':>9} {'n':>3} {'count':>7} "
            f"{'bytes':>12} {'min(us)':>9} {'med(us)':>9} {'max(us)':>9} {'algbw':>8} "
            f"{'busbw':>8}")
    if gathered:
        head += f" {'spread(us)':>10} {'skew(us)':>9} {'last':>4}"
    lines.append(head)
    for r in rows:
        line = (f"{r['level']:<5} {r['op']:<18} {r['backend']:<8} {r['bucket']:>9} "
                f"{r['group_size']:>3} {r['count']:>7} {r['bytes']:>12} "
                f"{num(r['lat_min_us'], 9)} {num(r['lat_median_us'], 9)} "
                f"{num(r['lat_max_us'], 9)} {num(r['algbw_GBps'], 8, 3)} "
                f"{num(r['busbw_GBps'], 8, 3)}")
        if gathered:
            last = r.get("last_arrival_rank")
            line += (f" {num(r.get('lat_median_spread_us'), 10)} "
                     f"{num(r.get('arrival_skew_median_us'), 9)} "
                     f"{'-' if last is None else last:>4}")
        lines.append(line)
    if not rows:
        lines.append("(no calls logged: turn logging on with mcrdl.configure(logging=True))")
    lines.append("# algbw/busbw in GB/s (1e9 B/s), nccl-tests formulas on the median latency; "
                 "spread: max - min over ranks of their median latency; skew: median over "
                 "calls of latest - earliest issue time; last: rank most often last to issue")
    return "\n".join(lines)


def export_log(path: str, *, format: str | None = None, gather: bool = False,
               level: str | None = None) -> str | None:
    """Write the summary rows as JSON (``{"rows": [...], ...}``) or CSV (one row per
    line, header first); format from `format` or the file suffix. With gather=True
    (collective) rank 0 writes the pooled rows and returns the path, others None."""
    fmt = format or ("csv" if str(path).endswith(".csv") else "json")
    if fmt not in ("json", "csv"):
        raise InvalidArgumentError(f"export_log: 'format' is {fmt!r}; expected 'json' or 'csv'")
    rows = summary(gather=gather, level=level, quiet=True)
    if gather and logger().rank != 0:
        return None
    fields = list(ROW_FIELDS) + ([f for f in STRAGGLER_FIELDS if any(f in r for r in rows)])
    with open(path, "w", encoding="utf-8", newline="") as f:
        if fmt == "json":
            json.dump({"rank": None if gather else logger().rank, "gathered": gather,
                       "fields": fields, "rows": rows}, f, indent=1)
        else:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return str(path)


def _trace_events(log: CommLogger) -> list[dict]:
    """This rank's records as complete events; overlapping calls of one backend lane go
    to numbered sub-lanes so that events of one tid never overlap."""
    recs = log.records()
    lanes: dict[str, list[int]] = {}  # lane name -> end time (ns) of each sub-lane
    out = []
    for r in recs:
        base = r.backend if r.level == "call" else f"{r.backend} wire"
        ends = lanes.setdefault(base, [])
        i = next((k for k, end in enumerate(ends) if end <= r.t0), len(ends))
        if i == len(ends):
            ends.append(0)
        ends[i] = r.t1
        lane = base if i == 0 else f"{base} #{i + 1}"
        out.append({"name": r.op, "cat": f"mcrdl.{r.level}", "ph": "X",
                    "ts": log.host_ns(r.t0), "dur": (r.t1 - r.t0) / 1000.0,
                    "lane": lane,
                    "args": {"backend": r.backend, "bytes": r.nbytes, "group": r.gid,
                             "group_size": r.gsize, "seq": r.seq, "async": r.async_op,
                             "level": r.level}})
    return out


def export_trace(path: str, *, gather: bool = False) -> str | None:
    """Write a Chrome-trace JSON of every logged call (open it in https://ui.perfetto.dev
    or chrome://tracing): one process per rank, one thread per backend lane.

    With gather=True (collective: every rank calls it) rank 0 writes every rank's events
    into `path` and returns it; the others return None. Else each rank writes its own
    (put ``{rank}`` in `path` to keep them apart)."""
    log = logger()
    mine = {"rank": log.rank, "events": _trace_events(log), "dropped": log.dropped}
    if gather:
        views = _allgather(mine)
        if log.rank != 0:
            return None
    else:
        views = [mine]
    events = []
    origin = min((e["ts"] for v in views for e in v["events"]), default=0)  # ns
    for v in views:
        pid = v["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        tids: dict[str, int] = {}
        for e in v["events"]:
            lane = e.pop("lane")
            if lane not in tids:
                tids[lane] = len(tids) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": pid,
                               "tid": tids[lane], "args": {"name": lane}})
            e["pid"], e["tid"] = pid, tids[lane]
            e["ts"] = round((e["ts"] - origin) / 1000.0, 3)
            e["dur"] = round(e["dur"], 3)
            events.append(e)
    out = str(path).format(rank=log.rank)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"producer": "mcrdl", "ranks": [v["rank"] for v in views],
                                 "dropped_events": sum(v["dropped"] for v in views),
                                 "clock": "host time_ns (microseconds from the first event)"}},
                  f)
    return out


