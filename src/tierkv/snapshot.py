"""Portable snapshots of an L3 directory: ship a warmed cache to another node (docs/design.md §14).

A snapshot is a plain tar file with three members:

- ``manifest.json``: format, layout (and fingerprint), model id and revision,
  block bytes, counts, the sha256 of the two other members, namespace labels;
- ``records.jsonl``: one line per block (key, parent, depth, created, xxh3 of its bytes, hits);
- ``blocks.bin``: the blocks' bytes, back to back, in ``records.jsonl`` order.

Export reads every block through the L3 checksum, so a snapshot never carries
a corrupt block. Import refuses a snapshot whose layout fingerprint, model id
or revision differs from the target L3's, verifies every checksum, and writes
blocks parents first so the target's chains are complete at every moment.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tierkv.catalog import Catalog, open_disk, stored_layouts
from tierkv.identity import IDENTITY_PREFIX
from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage
from tierkv.tiers.disk import DiskTier

FORMAT = "tierkv-l3-snapshot-v1"
_BATCH = 64


class SnapshotError(ValueError):
    """A snapshot that cannot be read or does not fit the target store."""


@dataclass(frozen=True)
class SnapshotReport:
    blocks: int
    skipped: int
    bytes: int
    seconds: float
    manifest: dict


def export_l3(l3: DiskTier, catalog: Catalog, dest: str | Path) -> SnapshotReport:
    """Write every readable block of ``l3`` to the tar file ``dest`` (atomically: temp file, then rename)."""
    started = time.perf_counter()
    dest = Path(dest)
    meta = l3.meta()
    records = sorted(l3.records(), key=lambda r: (r.depth, r.key))
    hits = catalog.hits()
    skipped = roots = 0
    lines = []
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as tmp:
        blocks_path = Path(tmp) / "blocks.bin"
        data_sha = hashlib.sha256()
        with open(blocks_path, "wb") as out:
            for rec in records:
                raw = l3.read_raw(rec.key)
                if raw is None:
                    skipped += 1
                    continue
                out.write(raw)
                data_sha.update(raw)
                roots += rec.depth == 0
                lines.append(json.dumps({
                    "key": rec.key.hex(), "parent": rec.parent.hex() if rec.parent else None,
                    "depth": rec.depth, "created": rec.created, "xxh3": xxhash.xxh3_64_hexdigest(raw),
                    "hits": list(hits.get(rec.key, (0, 0.0))),
                }))
        records_blob = ("\n".join(lines) + "\n").encode() if lines else b""
        exported = {json.loads(line)["key"] for line in lines}
        labels = {k.hex(): ns for k, ns in catalog.namespaces().items() if k.hex() in exported}
        manifest = {
            "format": FORMAT,
            "layout": l3.layout.to_dict(),
            "layout_fingerprint": l3.layout.fingerprint,
            "model_id": meta.get("model_id", "unknown-model"),
            "model_revision": meta.get("model_revision", "main"),
            "block_bytes": l3.block_bytes,
            "counts": {"blocks": len(lines), "roots": roots},
            "checksums": {"blocks.bin": data_sha.hexdigest(),
                          "records.jsonl": hashlib.sha256(records_blob).hexdigest()},
            "namespaces": labels,
            # The model identities that wrote here (identity.py): an importing store finds blocks
            # only under its own, and `tierkv why` / `info` can name what differs.
            "identities": {k: v for k, v in meta.items() if k.startswith(IDENTITY_PREFIX)},
            "created": time.time(),
        }
        partial = dest.with_name(dest.name + ".partial")
        with tarfile.open(partial, "w") as tar:
            _add_bytes(tar, "manifest.json", json.dumps(manifest, indent=2).encode())
            _add_bytes(tar, "records.jsonl", records_blob)
            tar.add(blocks_path, arcname="blocks.bin")
        os.replace(partial, dest)
    return SnapshotReport(len(lines), skipped, len(lines) * l3.block_bytes, time.perf_counter() - started, manifest)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def read_manifest(path: str | Path) -> dict:
    """The manifest of a snapshot, validated; SnapshotError naming the problem otherwise."""
    try:
        with tarfile.open(path, "r") as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.loads(member.read())
    except FileNotFoundError:
        raise
    except (tarfile.TarError, KeyError, AttributeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"{path}: not a tierkv snapshot ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    return manifest


def check_compatible(manifest: dict, l3_path: str | Path) -> KVLayout:
    """The snapshot's layout, after checking its model against the L3 directory of that layout under
    ``l3_path`` (if any)."""
    layout = KVLayout(**manifest["layout"])
    if layout.fingerprint != manifest["layout_fingerprint"]:
        raise SnapshotError("manifest: layout_fingerprint does not match its layout; the snapshot is damaged")
    # Blocks of another layout (another dtype) live in their own directory under l3_path: no conflict.
    found = [e for e in stored_layouts(l3_path) if e[1].fingerprint == layout.fingerprint]
    if not found:
        return layout
    _, _, _, meta = found[0]
    for field in ("model_id", "model_revision"):
        mine, theirs = meta.get(field), manifest.get(field)
        if mine is not None and mine != theirs:
            raise SnapshotError(
                f"import refused: the snapshot was made for {field} {theirs!r}, the store at {l3_path} "
                f"holds {field} {mine!r}; import into another --cache-dir or clear this one with `tierkv evict --all`")
    return layout


def import_l3(src: str | Path, l3_path: str | Path, capacity_blocks: int, direct_io: bool = True,
              progress=None) -> SnapshotReport:
    """Load snapshot ``src`` into the L3 at ``l3_path`` (created with the snapshot's layout if absent).

    ``progress(n)`` is called with the blocks written so far. Blocks already
    present are kept. Raises SnapshotError when the snapshot is damaged or does
    not fit the store.
    """
    started = time.perf_counter()
    manifest = read_manifest(src)
    layout = check_compatible(manifest, l3_path)
    count = manifest["counts"]["blocks"]
    meta = {"model_id": manifest["model_id"], "model_revision": manifest["model_revision"]}
    meta.update({k: v for k, v in (manifest.get("identities") or {}).items()
                 if isinstance(k, str) and k.startswith(IDENTITY_PREFIX) and isinstance(v, str)})
    with tarfile.open(src, "r") as tar:
        records_blob = tar.extractfile("records.jsonl").read()
        if hashlib.sha256(records_blob).hexdigest() != manifest["checksums"]["records.jsonl"]:
            raise SnapshotError(f"{src}: records.jsonl does not match its checksum; the snapshot is damaged")
        records = [json.loads(line) for line in records_blob.decode().splitlines() if line]
        if len(records) != count:
            raise SnapshotError(f"{src}: manifest counts {count} blocks, records.jsonl holds {len(records)}")
        l3 = open_disk(l3_path, layout, max(capacity_blocks, count), meta=meta, direct_io=direct_io)
        try:
            written = _copy_blocks(tar.extractfile("blocks.bin"), records, l3, manifest, src, progress)
        finally:
            l3.close()
    catalog = Catalog(l3_path)
    try:
        by_ns: dict[str, list[bytes]] = {}
        for key, ns in manifest.get("namespaces", {}).items():
            by_ns.setdefault(ns, []).append(bytes.fromhex(key))
        for ns, roots in by_ns.items():
            catalog.label(roots, ns)
        catalog.set_hits({bytes.fromhex(r["key"]): tuple(r["hits"]) for r in records if r.get("hits", [0])[0]})
    finally:
        catalog.close()
    return SnapshotReport(written, count - written, written * layout.block_bytes,
                          time.perf_counter() - started, manifest)


def _copy_blocks(data, records: list[dict], l3: DiskTier, manifest: dict, src, progress) -> int:
    layout = l3.layout
    sha = hashlib.sha256()
    written = 0
    for start in range(0, len(records), _BATCH):
        batch = records[start:start + _BATCH]
        keys, blocks, lineage = [], [], []
        for rec in batch:
            raw = data.read(layout.block_bytes)
            if len(raw) != layout.block_bytes:
                raise SnapshotError(f"{src}: blocks.bin is truncated at block {start + len(keys)}")
            sha.update(raw)
            if xxhash.xxh3_64_hexdigest(raw) != rec["xxh3"]:
                raise SnapshotError(f"{src}: block {rec['key']} does not match its checksum; the snapshot is damaged")
            block = torch.frombuffer(bytearray(raw), dtype=layout.torch_dtype).view(layout.block_shape)
            keys.append(bytes.fromhex(rec["key"]))
            blocks.append(block)
            lineage.append(Lineage(bytes.fromhex(rec["parent"]) if rec["parent"] else None, rec["depth"]))
        ok = l3.put(keys, blocks, lineage)
        written += sum(ok)
        if not all(ok):
            raise SnapshotError(f"l3: could not write block {keys[ok.index(False)].hex()} "
                                f"(full or IO error); raise l3.capacity or free space")
        if progress is not None:
            progress(written)
    if sha.hexdigest() != manifest["checksums"]["blocks.bin"]:
        raise SnapshotError(f"{src}: blocks.bin does not match its checksum; the snapshot is damaged")
    return written
