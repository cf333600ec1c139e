"""Shared benchmark plumbing: argument parsing, one table, targets, one JSON file.

Every benchmark states its targets with ``target(...)`` and ends with ``finish(...)``:
the targets go into the JSON (``bench/summary.py`` prints them all as one table) and,
with ``--check``, a missed target makes the process exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (<= 60 s)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    return p


def median_of(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` (seconds)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """(median, low, high): the median and its 95 % confidence interval from order statistics
    (distribution free: the ranks n/2 -/+ 1.96 sqrt(n)/2); nan for no values."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return float("nan"), float("nan"), float("nan")
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    half = 0.98 * n ** 0.5
    lo, hi = int(n / 2 - half), int(n / 2 + 1 + half + 0.999999)  # 1-based ranks, rounded outwards
    return mid, xs[max(lo - 1, 0)], xs[min(hi - 1, n - 1)]


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    print(f"{'metric'.ljust(w0)}  {'value'.rjust(w1)}  note")
    print(f"{'-' * w0}  {'-' * w1}  ----")
    for name, value, note in rows:
        print(f"{name.ljust(w0)}  {value.rjust(w1)}  {note}")


def target(metric: str, value: float, op: str, bound: float, what: str = "") -> dict:
    """One target: ``value op bound`` with op '>=' or '<='; ``what`` says what the value is a ratio of."""
    if op not in (">=", "<="):
        raise ValueError(f"target op: expected '>=' or '<=', got {op!r}")
    ok = value >= bound if op == ">=" else value <= bound
    return {"metric": metric, "value": round(float(value), 4), "op": op, "bound": bound, "ok": bool(ok), "what": what}


def verdict(t: dict) -> str:
    return f"{t['value']:.3g} {t['op']} {t['bound']:g}: {'ok' if t['ok'] else 'MISSED'}"


def write_json(path: str | None, figures: dict) -> None:
    if not path:
        return
    out = dict(figures)
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")


def finish(args: argparse.Namespace, bench: str, figures: dict, targets: list[dict]) -> None:
    """Write the JSON (figures + targets), print the missed targets; with ``--check`` exit 1 on any."""
    figures = dict(figures, bench=bench, targets=targets)
    write_json(args.json, figures)
    missed = [t for t in targets if not t["ok"]]
    for t in missed:
        print(f"{bench}: target missed: {t['metric']} {verdict(t)}", file=sys.stderr)
    if getattr(args, "check", False) and missed:
        sys.exit(1)
