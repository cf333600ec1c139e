"""One table of every target the benchmarks checked, read from their JSON files (bench/results/*.json).

Usage: python bench/summary.py [DIR or FILES...] [--check]
A file without targets is listed as such; with --check the exit status is 1 when any target was missed
or a file could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_of(path: Path) -> list[tuple[str, str, str, str, str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [(path.stem, "-", "-", "-", f"UNREADABLE ({exc.__class__.__name__})")]
    bench = data.get("bench", path.stem)
    targets = data.get("targets")
    if not targets:
        return [(bench, "(no targets)", "-", "-", "info")]
    return [(bench, t["metric"], f"{t['value']:.3g}", f"{t['op']} {t['bound']:g}", "ok" if t["ok"] else "MISSED")
            for t in targets]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", default=["bench/results"])
    p.add_argument("--check", action="store_true", help="exit 1 when a target was missed")
    args = p.parse_args()
    files: list[Path] = []
    for raw in args.paths:
        path = Path(raw)
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        print(f"no benchmark results under {', '.join(args.paths)}", file=sys.stderr)
        return 1
    rows = [r for f in files for r in rows_of(f)]
    head = ("bench", "target", "value", "bound", "result")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    print("\nbenchmark summary")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) if i in (0, 1, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    bad = [r for r in rows if r[4] not in ("ok", "info")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows ok" + (f"; {len(bad)} missed or unreadable" if bad else ""))
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
