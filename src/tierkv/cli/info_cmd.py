"""`tierkv info`: config, layout, every tier's capacity, usage and counters, and RDMA devices."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from tierkv.catalog import Catalog, open_dir, stored_layouts
from tierkv.cli.common import (
    CacheDir, CLIError, ConfigFile, Debug, Json, app, console, human_age, human_bytes, print_json, settings,
)
from tierkv.identity import recorded
from tierkv.metrics import TIER_NAMES
from tierkv.tiers.disk_open import damaged_dirs


def read_metrics(url: str, timeout: float = 5.0) -> dict:
    """Per-tier figures from a running server's Prometheus ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise CLIError(f"--url: cannot read {url}: {getattr(exc, 'reason', exc)}") from None
    tiers = {t: {"hits": 0, "evictions": 0, "blocks": None, "capacity_blocks": None, "bytes_read": 0,
                 "bytes_write": 0, "corrupt": 0} for t in TIER_NAMES}
    totals: dict[str, float] = {}
    names = {"tierkv_hits": "hits", "tierkv_evictions": "evictions", "tierkv_blocks": "blocks",
             "tierkv_capacity_blocks": "capacity_blocks", "tierkv_corrupt_blocks": "corrupt"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tier = sample.labels.get("tier")
            base = sample.name.removesuffix("_total")
            if base in names and tier in tiers:
                tiers[tier][names[base]] = int(sample.value)
            elif base == "tierkv_bytes" and tier in tiers:
                tiers[tier][f"bytes_{sample.labels.get('direction')}"] = int(sample.value)
            elif sample.name.startswith("tierkv_") and not sample.labels:
                totals[sample.name] = sample.value
    return {"url": url, "tiers": tiers, "totals": totals}


def local_info(s) -> dict:
    cfg = s.config
    out = {
        "cache_dir": str(s.cache_dir),
        "config": {"model_id": cfg.model_id, "model_revision": cfg.model_revision, "namespace": cfg.namespace,
                   "policy": cfg.policy.name, "write": cfg.policy.write, "hashing": cfg.hashing.algorithm},
        "tiers": {
            "l1": {"where": "engine device pool (per process)", "capacity_bytes": None},
            "l2": {"where": f"/dev/shm/tierkv-{cfg.l2.shared_name}" if cfg.l2.shared_name else "process RAM",
                   "capacity_bytes": cfg.l2.capacity},
            "l3": {"where": str(s.l3_path), "capacity_bytes": cfg.l3.capacity, "present": False},
            "l4": {"where": cfg.l4.url or "(none)", "compress": {"mode": cfg.l4.compress}},
        },
        "rdma": rdma_info(),
    }
    l3 = out["tiers"]["l3"]
    l3["compress"] = {"mode": cfg.l3.compress}
    aside = damaged_dirs(s.l3_path)
    l3["damaged"] = {"count": len(aside), "bytes": sum(_tree_bytes(d) for d in aside), "dirs": [d.name for d in aside]}
    every = stored_layouts(s.l3_path)  # one directory per layout: the root's first
    if not every:
        return out
    if len(every) > 1:
        l3["layouts"] = [{"fingerprint": lay.fingerprint, "dtype": lay.dtype, "dir": str(d), "capacity_blocks": cap,
                          "identities": [ident.digest for ident, _ in recorded(meta)]}
                         for d, lay, cap, meta in every]
    disk = open_dir(every[0][0], cfg.l3.direct_io)
    try:
        meta = disk.meta()
        l3.update(present=True, capacity_blocks=disk.capacity, used_blocks=disk.used,
                  capacity_bytes=disk.capacity * disk.stride, used_bytes=disk.used * disk.block_bytes,
                  direct_io=disk.direct, model_id=meta.get("model_id"), model_revision=meta.get("model_revision"))
        l3["identities"] = [{"digest": ident.digest, "last_opened": seen, "fields": ident.field_digests()}
                            for ident, seen in recorded(meta)]
        l3["compress"] = _l3_compression(disk, cfg.l3.compress, meta)
        out["layout"] = {**disk.layout.to_dict(), "fingerprint": disk.layout.fingerprint,
                         "block_bytes": disk.layout.block_bytes}
        catalog = Catalog(s.l3_path)
        hits = catalog.hits()
        labels = catalog.namespaces()
        catalog.close()
        l3["hits_recorded"] = sum(n for n, _ in hits.values())
        l3["last_hit_age_s"] = round(time.time() - max(t for _, t in hits.values()), 1) if hits else None
        l3["namespaces"] = sorted({ns or "(default)" for ns in labels.values()})
        if cfg.l4.url:
            out["tiers"]["l4"].update(_probe_l4(cfg, disk.layout))
    finally:
        disk.close()
    return out


def _l3_compression(disk, mode: str, meta: dict) -> dict:
    """How the L3 directory's blocks are stored (a walk of its records) and, for ``auto``, what
    the last store that wrote there decided (the ``compress_auto`` meta record)."""
    blocks = coded = stored = 0
    for rec in disk.records():
        blocks += 1
        if rec.flags:
            coded += 1
            stored += rec.stored
    return {"mode": mode, "blocks": blocks, "compressed_blocks": coded,
            "ratio": round(coded * disk.block_bytes / stored, 3) if coded else None,
            "auto": meta.get("compress_auto")}


def compression_lines(tiers: dict) -> list[str]:
    """What ``tierkv info`` says about l3/l4.compress and what auto chose."""
    lines = []
    l3 = tiers["l3"]["compress"]
    line = f"l3 compress {l3['mode']}"
    if l3["mode"] == "auto":
        line += f" ({l3.get('auto') or 'not decided yet: no store has measured this directory'})"
    if l3.get("blocks"):
        ratio = f", {l3['ratio']:.2f}x" if l3["ratio"] else ""
        line += f"; {l3['compressed_blocks']} of {l3['blocks']} blocks stored compressed{ratio}"
    lines.append(line)
    if tiers["l4"]["where"] != "(none)":
        mode = tiers["l4"]["compress"]["mode"]
        lines.append(f"l4 compress {mode}" + (" (each store decides from its own gets: zstd only where its "
                                              "measured bandwidth predicts >= 1.2x raw)" if mode == "auto" else ""))
    return lines


def _tree_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # deleted while we count
                pass
    return total


def rdma_info() -> dict:
    """What ``rdma.detect()`` found: devices with their ports, or why none is usable. Never raises."""
    from tierkv.tiers.remote import rdma

    report = rdma.detect()
    devices = [{"name": d.name, "ports": [{"number": p.number, "state": p.state, "link_layer": p.link_layer,
                                           "gids": list(p.gids)} for p in d.ports]} for d in report.devices]
    return {"usable": report.usable, "source": report.source, "reason": report.reason, "devices": devices,
            "errors": dict(report.details)}


def rdma_lines(info: dict) -> list[str]:
    """``tierkv info``'s RDMA lines: one per device port, then what Mooncake will use and why."""
    lines = []
    for dev in info["devices"]:
        for port in dev["ports"]:
            gids = f", GIDs {', '.join(port['gids'])}" if port["gids"] else ", no GID"
            lines.append(f"rdma device {dev['name']} port {port['number']}: {port['state']} ({port['link_layer']}){gids}")
    lines += [f"rdma device {name}: cannot be opened ({err})" for name, err in info["errors"].items()]
    if info["usable"]:
        lines.append(f"rdma: {', '.join(info['usable'])} usable (via {info['source']}); "
                     "Mooncake L4 uses RDMA on them (protocol=auto)")
    else:
        lines.append(f"rdma: none usable, {info['reason']}; Mooncake L4 falls back to TCP")
    return lines


def _probe_l4(cfg, layout) -> dict:
    """Reachability and description of the L4 pool: one membership probe through the real tier."""
    failures: list[str] = []
    try:
        from tierkv.tiers.remote import open_remote

        remote = open_remote(cfg.l4, layout, lambda tier, reason, n, detail: failures.append(f"{reason}: {detail}"))
    except (ValueError, ImportError) as exc:
        return {"reachable": False, "error": str(exc)}
    try:
        remote.contains([bytes(16)])
        stats = remote.stats()
    finally:
        remote.close()
    out = {k: v for k, v in stats.items() if k in ("backend", "protocol", "breaker", "authenticated")}
    out["reachable"] = not failures
    if failures:
        out["error"] = failures[0]
    return out


@app.command("info", epilog="Examples: `tierkv info`, `tierkv info --url http://127.0.0.1:8000 --json`")
def info_cmd(
    url: Annotated[str | None, typer.Option("--url", help="Read a running `tierkv serve` at this URL (its /metrics).")] = None,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Show the config, the block layout, each tier's capacity, usage and counters, and RDMA devices."""
    if url is not None:
        data = read_metrics(url)
        if json_out:
            print_json(data)
            return
        table = Table(title=f"tierkv at {data['url']}")
        for col in ("tier", "blocks", "capacity", "hits", "evictions", "read", "written", "corrupt"):
            table.add_column(col, justify="right")
        for tier, v in data["tiers"].items():
            table.add_row(tier, _opt(v["blocks"]), _opt(v["capacity_blocks"]), str(v["hits"]), str(v["evictions"]),
                          human_bytes(v["bytes_read"]), human_bytes(v["bytes_write"]), str(v["corrupt"]))
        console.print(table)
        t = data["totals"]
        console.print(f"lookups {t.get('tierkv_lookups_total', 0):.0f}, blocks missed {t.get('tierkv_misses_total', 0):.0f}")
        return
    s = settings(cache_dir, config, debug)
    data = local_info(s)
    if json_out:
        print_json(data)
        return
    cfg = data["config"]
    console.print(f"[bold]cache dir[/] {data['cache_dir']}   policy {cfg['policy']} ({cfg['write']})   "
                  f"hashing {cfg['hashing']}" + (f"   namespace {cfg['namespace']!r}" if cfg["namespace"] else ""))
    if "layout" in data:
        lay = data["layout"]
        console.print(f"[bold]layout[/] {lay['fingerprint']}: {lay['num_layers']} layers x {lay['num_kv_heads']} kv heads "
                      f"x {lay['head_dim']} dim, {lay['block_size']} tokens/block, {lay['dtype']}, "
                      f"{human_bytes(lay['block_bytes'])}/block")
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("tier", "where", "capacity", "used"):
        table.add_column(col)
    tiers = data["tiers"]
    table.add_row("l1", "engine process (device pool)", "-", "-")
    table.add_row("l2", tiers["l2"]["where"], human_bytes(tiers["l2"]["capacity_bytes"]), "-")
    l3 = tiers["l3"]
    if l3["present"]:
        table.add_row("l3", l3["where"], f"{human_bytes(l3['capacity_bytes'])} ({l3['capacity_blocks']} blocks)",
                      f"{human_bytes(l3['used_bytes'])} ({l3['used_blocks']} blocks)")
    else:
        table.add_row("l3", l3["where"], human_bytes(l3["capacity_bytes"]), "not created yet")
    l4 = tiers["l4"]
    state = "" if l4["where"] == "(none)" else (f" ({l4.get('backend', '?')}, reachable)" if l4.get("reachable")
                                                 else f" (unreachable: {l4.get('error', '?')})")
    table.add_row("l4", l4["where"] + state, "pool-managed" if state else "-", "-")
    console.print(table)
    if l3["present"]:
        console.print(f"l3 holds model {l3['model_id']}@{l3['model_revision']}; {l3['hits_recorded']} block hits "
                      f"recorded; namespaces: {', '.join(l3['namespaces']) or '-'}")
    if len(l3.get("layouts", [])) > 1:
        console.print(f"l3 holds {len(l3['layouts'])} layouts, each in its own directory (the first is shown above): "
                      + "; ".join(f"{x['fingerprint'][:12]} {x['dtype']}" for x in l3["layouts"]))
    for ident in l3.get("identities", []):
        fields = "  ".join(f"{k} {v[:8]}" for k, v in ident["fields"].items())
        console.print(f"identity {ident['digest'][:12]} (opened {human_age(time.time() - ident['last_opened'])} ago): "
                      f"{fields}", markup=False, soft_wrap=True)
    for line in compression_lines(tiers):
        console.print(line, markup=False, soft_wrap=True)
    damaged = l3["damaged"]
    if damaged["count"]:
        noun = "directory" if damaged["count"] == 1 else "directories"
        console.print(f"l3: {damaged['count']} {noun} of damaged files moved aside at start "
                      f"({human_bytes(damaged['bytes'])}) in {l3['where']}: {', '.join(damaged['dirs'])}; "
                      "delete them once inspected", markup=False, soft_wrap=True)
    for line in rdma_lines(data["rdma"]):
        console.print(line, markup=False, soft_wrap=True)


def _opt(v) -> str:
    return "-" if v is None else str(v)
