"""Commands that read or change an L3 directory without an engine: ls, verify, evict, export, import."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

from tierkv.catalog import LAYOUTS_DIR, UNLABELLED, Catalog, evict, l3_dirs, open_dir, open_each, open_l3, orphans, stored_layout
from tierkv.cli.common import (
    CacheDir, CLIError, ConfigFile, Debug, Json, app, console, human_age, human_bytes, parse_duration,
    print_json, settings,
)
from tierkv.snapshot import SnapshotError, export_l3, import_l3, read_manifest
from tierkv.tiers.disk_open import DamagedL3


def _open(s, layout: str | None = None):
    """The one L3 directory under ``s.l3_path`` (or the one of ``layout``, a fingerprint prefix)."""
    try:
        return open_l3(s.l3_path, s.config.l3.direct_io, layout)
    except FileNotFoundError:
        raise CLIError(f"no L3 cache at {s.l3_path}" + (f" of layout {layout}" if layout else "")
                       + " (warm one with `tierkv run` or `tierkv warm`, or pass --cache-dir)") from None
    except DamagedL3:
        raise
    except ValueError as exc:  # several layouts and none named
        raise CLIError(str(exc), 2) from None


def _open_each(s) -> list:
    """Every layout's L3 directory under ``s.l3_path`` (fp32 and bf16 blocks live apart), root first."""
    disks = open_each(s.l3_path, s.config.l3.direct_io)
    if not disks:
        _open(s)  # raises the CLIError that says there is no L3
    return disks


def _close_all(disks) -> None:
    for d in disks:
        d.close()


# -- ls -------------------------------------------------------------------------


def _segments(records, labels, hits, now):
    """Collapse single-child runs of blocks into segments; returns (segments, parent id -> child segments).

    Iterative (a long conversation branches once per turn, deeper than Python's recursion limit).
    """
    by_key = {r.key: r for r in records}
    kids: dict[bytes, list[bytes]] = {}
    for r in records:
        if r.parent in by_key:
            kids.setdefault(r.parent, []).append(r.key)
    starts = sorted((r for r in records if r.parent not in by_key),
                    key=lambda r: (labels.get(r.key, UNLABELLED), r.created))
    segs, tree = [], {}
    todo = [(r.key, None, labels.get(r.key, UNLABELLED) if r.depth == 0 else "(orphan)") for r in reversed(starts)]
    while todo:
        first, parent_id, namespace = todo.pop()
        run = [by_key[first]]
        while len(kids.get(run[-1].key, ())) == 1:
            run.append(by_key[kids[run[-1].key][0]])
        seg = {
            "id": len(segs), "parent": parent_id, "namespace": namespace,
            "key": run[0].key.hex(), "depth": [run[0].depth, run[-1].depth], "blocks": len(run),
            "tier": "l3", "hits": hits.get(run[0].key, (0, 0.0))[0],
            "age_s": round(now - min(r.created for r in run), 1),
        }
        segs.append(seg)
        tree.setdefault(parent_id, []).append(seg)
        children = sorted(kids.get(run[-1].key, ()), key=lambda k: -hits.get(k, (0, 0.0))[0])
        todo.extend((child, seg["id"], namespace) for child in reversed(children))
    return segs, tree


@app.command("ls", epilog="Example: `tierkv ls --namespace demo --depth 2`")
def ls_cmd(
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only chains hashed under this namespace.")] = None,
    depth: Annotated[int, typer.Option("--depth", "-d", min=1, max=100, help="Show at most this many levels of branching.")] = 8,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """List the cached prefixes in L3 as a tree: each line is a run of blocks with its depth, tier, hits and age."""
    s = settings(cache_dir, config, debug)
    disks = _open_each(s)
    catalog = Catalog(s.l3_path)
    try:
        labels, hits, now = catalog.namespaces(), catalog.hits(), time.time()
        parts = []  # (layout, records, segments, tree) per layout directory
        for l3 in disks:
            records = list(l3.records())
            parts.append((l3.layout, records, *_segments(records, labels, hits, now)))
    finally:
        catalog.close()
        _close_all(disks)
    several = len(parts) > 1
    if json_out:
        out, first = [], 0
        for layout, _, segs, tree in parts:
            tops = [g for g in tree.get(None, []) if namespace is None or g["namespace"] == namespace]
            keep = subtree_ids(tops, tree)
            for g in segs:
                if g["id"] in keep:  # ids unique across layouts
                    g = {**g, "id": g["id"] + first, "parent": None if g["parent"] is None else g["parent"] + first}
                    out.append({**g, "layout": layout.fingerprint} if several else g)
            first += len(segs)
        doc = {"block_size": parts[0][0].block_size, "segments": out}
        if several:
            doc["layouts"] = [{"fingerprint": lay.fingerprint, "dtype": lay.dtype, "block_size": lay.block_size,
                               "blocks": len(recs)} for lay, recs, _, _ in parts]
        print_json(doc)
        return
    for layout, records, segs, tree in parts:
        tops = [g for g in tree.get(None, []) if namespace is None or g["namespace"] == namespace]
        where = f"{s.l3_path} [layout {layout.fingerprint[:12]} {layout.dtype}]" if several else f"{s.l3_path}"
        root = Tree(f"[bold]{where}[/] — {len(records)} blocks, {len(tops)} chain{'s' if len(tops) != 1 else ''}"
                    + (f" in namespace {namespace!r}" if namespace is not None else ""))
        by_ns: dict[str, Tree] = {}
        for g in tops:
            ns_node = by_ns.get(g["namespace"])
            if ns_node is None:
                ns_node = by_ns[g["namespace"]] = root.add(f"namespace [cyan]{g['namespace'] or '(default)'}[/]")
            _render(ns_node, g, tree, layout.block_size, depth)
        console.print(root)


def subtree_ids(tops, tree) -> set[int]:
    out, todo = set(), list(tops)
    while todo:
        g = todo.pop()
        out.add(g["id"])
        todo.extend(tree.get(g["id"], []))
    return out


def _render(node: Tree, g: dict, tree: dict, bs: int, levels: int) -> None:
    lo, hi = g["depth"]
    label = (f"blocks {lo}..{hi} ({(hi - lo + 1) * bs} tokens)  tier {g['tier']}  hits {g['hits']}"
             f"  age {human_age(g['age_s'])}  [dim]{g['key'][:12]}[/]")
    child = node.add(label)
    kids = tree.get(g["id"], [])
    if levels <= 1:
        if kids:
            child.add(f"[dim]… {len(kids)} branches below (raise --depth)[/]")
        return
    for k in kids:
        _render(child, k, tree, bs, levels - 1)


# -- verify ---------------------------------------------------------------------


@app.command("verify", epilog="Example: `tierkv verify --repair`")
def verify_cmd(
    repair: Annotated[bool, typer.Option("--repair", help="Remove bad blocks and the blocks only reachable through them.")] = False,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Read every L3 block and check its checksum; exit 1 if bad blocks remain."""
    s = settings(cache_dir, config, debug)
    disks = _open_each(s)
    started = time.perf_counter()
    checked, bad, stranded = 0, [], set()
    try:
        for l3 in disks:  # every layout's directory
            n, wrong = l3.verify(repair=repair)
            checked += n
            bad += wrong
            if repair:
                lost = orphans(list(l3.records()))
                l3.remove(sorted(lost))
                stranded |= lost
        if repair and (bad or stranded):
            catalog = Catalog(s.l3_path)
            catalog.forget([*bad, *stranded])
            catalog.close()
    finally:
        _close_all(disks)
    report = {"path": str(s.l3_path), "checked": checked, "bad": [k.hex() for k in bad],
              "removed": len(bad) + len(stranded) if repair else 0, "orphans_removed": len(stranded),
              "seconds": round(time.perf_counter() - started, 3)}
    if json_out:
        print_json(report)
    else:
        table = Table(title=f"verify {s.l3_path}")
        for col in ("checked", "bad", "removed", "seconds"):
            table.add_column(col, justify="right")
        table.add_row(str(checked), str(len(bad)), str(report["removed"]), f"{report['seconds']:.2f}")
        console.print(table)
        for k in bad[:20]:
            console.print(f"bad block {k.hex()}")
        if bad and not repair:
            console.print("run `tierkv verify --repair` to remove them")
    if bad and not repair:
        raise typer.Exit(1)


# -- evict ----------------------------------------------------------------------


@app.command("evict", epilog="Examples: `tierkv evict --namespace tenant-a`, `tierkv evict --older-than 7d`, `tierkv evict --all`")
def evict_cmd(
    namespace: Annotated[list[str] | None, typer.Option("--namespace", "-n", help="Remove the chains of this namespace (repeatable).")] = None,
    older_than: Annotated[str | None, typer.Option("--older-than", help="Remove blocks written longer ago than this (90s, 15m, 2h, 3d).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove the whole L3 directory, whatever its layout. Stop servers using it first.")] = False,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Remove blocks from L3 by namespace, by age, or all of them; blocks below a removed one go too."""
    if sum([bool(namespace), older_than is not None, all_]) != 1:
        raise CLIError("evict: give exactly one of --namespace, --older-than, --all", 2)
    s = settings(cache_dir, config, debug)
    if all_:
        report = evict_all(s.l3_path)
    else:
        cutoff = time.time() - parse_duration(older_than, "--older-than") if older_than else None
        report = evict_some(s, set(namespace or ()), cutoff)
    if json_out:
        print_json(report)
    else:
        if "damaged" in report:
            console.print(f"cleared {s.l3_path}, which was damaged ({report['damaged']}); 0 left", markup=False)
        else:
            console.print(f"evicted {report['removed']} blocks ({human_bytes(report['bytes'])}) from {s.l3_path}; "
                          f"{report['left']} left")


def evict_all(l3_path: Path) -> dict:
    """Remove the L3 index, slot file and catalog; a damaged directory is cleared too (its block
    count unknown, reported as 0 with the damage). The damaged-* directories stay for inspection."""
    removed = nbytes = 0
    damaged = None
    for d in l3_dirs(l3_path):  # the root and every other layout's directory
        try:
            if stored_layout(d) is not None:
                l3 = open_dir(d)
                removed += l3.used
                nbytes += l3.used * l3.block_bytes
                l3.close()
        except DamagedL3 as exc:  # clearing is what --all is for
            damaged = str(exc)
    for name in ("index", "catalog", LAYOUTS_DIR):
        shutil.rmtree(l3_path / name, ignore_errors=True)
    (l3_path / "slots.bin").unlink(missing_ok=True)
    report = {"path": str(l3_path), "removed": removed, "bytes": nbytes, "left": 0}
    if damaged is not None:
        report["damaged"] = damaged
    return report


def evict_some(s, namespaces: set[str], cutoff: float | None) -> dict:
    """Remove the chains of ``namespaces`` or the blocks created before ``cutoff``, with their descendants."""
    disks = _open_each(s)
    catalog = Catalog(s.l3_path)
    removed = left = nbytes = 0
    try:
        for l3 in disks:  # every layout's directory
            n = evict(l3, catalog, namespaces, cutoff)
            removed, left, nbytes = removed + n, left + l3.used, nbytes + n * l3.block_bytes
    finally:
        catalog.close()
        _close_all(disks)
    return {"path": str(s.l3_path), "removed": removed, "bytes": nbytes, "left": left}


# -- export / import --------------------------------------------------------------


@app.command("export", epilog="Example: `tierkv export warm-cache.tar` then on another node `tierkv import warm-cache.tar`")
def export_cmd(
    file: Annotated[Path, typer.Argument(help="Snapshot file to write (a tar with a manifest).")],
    layout: Annotated[str | None, typer.Option("--layout", help="Where L3 holds several layouts: the fingerprint (or its start) of the one to export.")] = None,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Write every L3 block of one layout, checked, to a portable snapshot with a manifest (layout, model, counts, checksums)."""
    s = settings(cache_dir, config, debug)
    l3 = _open(s, layout)
    catalog = Catalog(s.l3_path)
    try:
        report = export_l3(l3, catalog, file)
    finally:
        catalog.close()
        l3.close()
    out = {"file": str(file), "blocks": report.blocks, "skipped_bad": report.skipped, "bytes": report.bytes,
           "seconds": round(report.seconds, 3), "layout_fingerprint": report.manifest["layout_fingerprint"],
           "model_id": report.manifest["model_id"], "model_revision": report.manifest["model_revision"]}
    if json_out:
        print_json(out)
    else:
        console.print(f"exported {report.blocks} blocks ({human_bytes(report.bytes)}) of layout "
                      f"{out['layout_fingerprint']}, model {out['model_id']}@{out['model_revision']} to {file} "
                      f"in {report.seconds:.2f} s" + (f"; skipped {report.skipped} bad blocks" if report.skipped else ""))


@app.command("import", epilog="Example: `tierkv import warm-cache.tar --cache-dir /mnt/nvme/tierkv`")
def import_cmd(
    file: Annotated[Path, typer.Argument(help="Snapshot file written by `tierkv export`.")],
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Load a snapshot into L3; refused when its layout or model differs from the store's."""
    s = settings(cache_dir, config, debug)
    if not file.exists():
        raise CLIError(f"import: no such file {file}")
    try:
        manifest = read_manifest(file)
        block_bytes = manifest["block_bytes"]
        total = manifest["counts"]["blocks"]
        with Progress(TextColumn("importing"), BarColumn(), TextColumn("{task.completed}/{task.total} blocks"),
                      TimeRemainingColumn(), console=console, disable=json_out or not console.is_terminal, transient=True) as bar:
            task = bar.add_task("import", total=total)
            report = import_l3(file, s.l3_path, s.config.l3.capacity // block_bytes, s.config.l3.direct_io,
                               progress=lambda n: bar.update(task, completed=n))
    except SnapshotError as exc:
        raise CLIError(str(exc)) from None
    out = {"file": str(file), "path": str(s.l3_path), "blocks": report.blocks, "bytes": report.bytes,
           "seconds": round(report.seconds, 3), "layout_fingerprint": manifest["layout_fingerprint"],
           "model_id": manifest["model_id"]}
    if json_out:
        print_json(out)
    else:
        console.print(f"imported {report.blocks} blocks ({human_bytes(report.bytes)}) into {s.l3_path} "
                      f"in {report.seconds:.2f} s")
