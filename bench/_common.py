"""Shared benchmark plumbing: argument parsing, one table, one JSON file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (<= 60 s)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    return p


def median_of(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` (seconds)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    print(f"{'metric'.ljust(w0)}  {'value'.rjust(w1)}  note")
    print(f"{'-' * w0}  {'-' * w1}  ----")
    for name, value, note in rows:
        print(f"{name.ljust(w0)}  {value.rjust(w1)}  {note}")


def write_json(path: str | None, figures: dict) -> None:
    if not path:
        return
    out = dict(figures)
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")
