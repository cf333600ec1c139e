"""What the tools know about an L3 directory beyond its slot index (docs/design.md §14).

An L3 record holds a block's key, parent, depth, checksum and creation time,
but not the namespace its chain was hashed under (a key cannot be inverted)
nor how often it was hit. The ``tierkv`` tools that know both — ``warm``,
``run``, ``serve``, ``import`` — write them here, in a small LMDB environment
``catalog/`` beside the slot index:

- ``ns``:   root key (depth 0) -> namespace (utf-8)
- ``hits``: key -> (hit count, last hit time)

The catalog is advisory: a chain without a label shows as namespace ``?`` and
a block without a count as 0 hits. Several processes may write it at once
(LMDB serialises writers). One catalog serves every layout under ``l3.path``
(keys bind the layout, so they never collide).

One ``l3.path`` holds blocks of any number of layouts (fp32 and bf16 of one
model, two models): the first layout's slot index and file sit at its root,
each other layout's in ``layouts/<layout fingerprint>/`` (``l3_dir_for``), so
a store of another dtype opens its own, empty, directory (0 hits) instead of
being refused. This module also opens existing L3 directories with the layout
and capacity they were created with, for the offline commands.
"""

from __future__ import annotations

import ast
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import lmdb

from tierkv.layout import KVLayout
from tierkv.tiers.disk import DiskTier, Record
from tierkv.tiers.disk_open import Damaged, ForeignLayout, check_before_mapping, damaged_error

_HIT = struct.Struct("<Qd")  # count, last hit (unix seconds)
UNLABELLED = "?"


class Catalog:
    """Namespace labels and hit counts for the blocks of one L3 directory. Thread-safe."""

    def __init__(self, l3_path: str | Path) -> None:
        path = Path(l3_path).expanduser() / "catalog"
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=1 << 30, max_dbs=2, subdir=True, lock=True)
        self._ns = self._env.open_db(b"ns")
        self._hits = self._env.open_db(b"hits")

    def label(self, roots: Iterable[bytes], namespace: str) -> None:
        """Record that the chains starting at ``roots`` were hashed under ``namespace``."""
        with self._env.begin(write=True) as txn:
            for root in roots:
                txn.put(root, namespace.encode(), db=self._ns)

    def namespaces(self) -> dict[bytes, str]:
        with self._env.begin() as txn:
            return {bytes(k): bytes(v).decode() for k, v in txn.cursor(db=self._ns)}

    def count_hits(self, keys: Sequence[bytes], when: float | None = None) -> None:
        """Add one hit to each of ``keys`` (the blocks one request found cached)."""
        if keys:
            with self._env.begin(write=True) as txn:
                self._add_hits(txn, keys, time.time() if when is None else when)

    def record(self, keys: Sequence[bytes], namespace: str, hit_blocks: int) -> None:
        """One finished request in one transaction: label its chain ``keys`` with ``namespace``
        and count a hit on its first ``hit_blocks`` blocks."""
        if not keys:
            return
        with self._env.begin(write=True) as txn:
            txn.put(keys[0], namespace.encode(), db=self._ns)
            self._add_hits(txn, keys[:hit_blocks], time.time())

    def _add_hits(self, txn, keys: Sequence[bytes], when: float) -> None:
        for key in keys:
            raw = txn.get(key, db=self._hits)
            n = _HIT.unpack(raw)[0] if raw is not None else 0
            txn.put(key, _HIT.pack(n + 1, when), db=self._hits)

    def set_hits(self, counts: dict[bytes, tuple[int, float]]) -> None:
        """Overwrite the hit counts of ``counts``' keys (import of a snapshot)."""
        with self._env.begin(write=True) as txn:
            for key, (n, when) in counts.items():
                txn.put(key, _HIT.pack(n, when), db=self._hits)

    def hits(self) -> dict[bytes, tuple[int, float]]:
        with self._env.begin() as txn:
            return {bytes(k): _HIT.unpack(v) for k, v in txn.cursor(db=self._hits)}

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop labels and counts of removed blocks."""
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key, db=self._ns)
                txn.delete(key, db=self._hits)

    def close(self) -> None:
        self._env.close()


def stored_layout(l3_path: str | Path) -> tuple[KVLayout, int, dict[str, str]] | None:
    """(layout, capacity in blocks, meta) of an existing L3 directory, or None if there is none.

    Reads the LMDB meta table without opening the slot file, so it works on a
    directory of any layout. A damaged directory raises ValueError naming it (and
    moves nothing): the index is walked in a child process before this one maps it,
    as a store's start does, since LMDB kills a process reading a truncated index.
    """
    path = Path(l3_path).expanduser()
    index = path / "index"
    if not (index / "data.mdb").exists():
        return None
    try:
        check_before_mapping(path)
    except Damaged as damage:
        raise damaged_error(path, damage.what) from None
    env = lmdb.open(str(index), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        meta_db = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            meta = {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor(db=meta_db)}
    except lmdb.Error:
        return None
    except UnicodeDecodeError as exc:
        raise damaged_error(path, f"a meta record is not text ({exc})") from None
    finally:
        env.close()
    if "layout" not in meta:
        return None
    try:
        layout = KVLayout(**ast.literal_eval(meta["layout"]))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise damaged_error(path, f"meta record 'layout' is unreadable: {meta['layout'][:80]!r}") from None
    try:
        capacity = int(meta.get("capacity", "0"))
    except ValueError:
        capacity = -1
    if capacity < 0:
        raise damaged_error(path, f"meta record 'capacity' is unreadable: {meta['capacity'][:32]!r}")
    return layout, capacity, meta


LAYOUTS_DIR = "layouts"


def layout_subdir(l3_path: str | Path, layout: KVLayout) -> Path:
    """Where the blocks of ``layout`` live under ``l3_path`` when its root holds another layout."""
    return Path(l3_path).expanduser() / LAYOUTS_DIR / layout.fingerprint


def l3_dirs(l3_path: str | Path) -> list[Path]:
    """The L3 directories under ``l3_path`` that hold a slot index: the root first, then one per
    other layout (``layouts/<fingerprint>``) by name. Reads nothing inside them."""
    root = Path(l3_path).expanduser()
    subs = sorted(p for p in (root / LAYOUTS_DIR).glob("*") if p.is_dir() and not p.is_symlink()) \
        if (root / LAYOUTS_DIR).is_dir() else []
    return [d for d in (root, *subs) if (d / "index" / "data.mdb").exists()]


def open_disk(l3_path: str | Path, layout: KVLayout, num_blocks: int, **kwargs) -> DiskTier:
    """The L3 tier of ``layout`` under ``l3_path`` (``DiskTier``'s keyword arguments pass through):
    its own ``layouts/<fingerprint>`` directory when one exists or the root holds another layout,
    else the root. Never refused for the layout: another dtype or model finds its own blocks only.
    A tensor-parallel shard always gets its own directory: ranks open theirs at the same moment,
    and none of them may take the root another rank is creating."""
    sub = layout_subdir(l3_path, layout)
    if layout.is_shard or (sub / "index" / "data.mdb").exists():
        return DiskTier(sub, layout, num_blocks, **kwargs)
    try:
        return DiskTier(l3_path, layout, num_blocks, **kwargs)
    except ForeignLayout:
        if not kwargs.get("create", True):
            raise FileNotFoundError(f"l3.path: no L3 blocks of layout {layout.fingerprint} under "
                                    f"{Path(l3_path).expanduser()}") from None
        return DiskTier(sub, layout, num_blocks, **kwargs)


def stored_layouts(l3_path: str | Path) -> list[tuple[Path, KVLayout, int, dict[str, str]]]:
    """(directory, layout, capacity in blocks, meta) of every L3 directory under ``l3_path``, root first.
    A damaged one raises ValueError naming it, as ``stored_layout`` does."""
    out = []
    for d in l3_dirs(l3_path):
        found = stored_layout(d)
        if found is not None:
            out.append((d, *found))
    return out


def other_layouts(l3_path: str | Path, own: str | Path | None) -> list[tuple[Path, KVLayout, dict[str, str]]]:
    """(directory, layout, meta) of the L3 directories under ``l3_path`` other than ``own`` (every
    one when None); a damaged one is left out (the store that opens it deals with it), and so is
    one this process holds open already (LMDB opens an environment once per process: another
    tensor-parallel rank's shard, in the scheduler's view)."""
    out = []
    mine = Path(own).expanduser().resolve() if own is not None else None
    for d in l3_dirs(l3_path):
        if d.resolve() == mine:
            continue
        try:
            found = stored_layout(d)
        except (ValueError, lmdb.Error):
            continue
        if found is not None:
            out.append((d, found[0], found[2]))
    return out


def open_dir(directory: str | Path, direct_io: bool = True) -> DiskTier:
    """Exactly the L3 directory ``directory`` (one of ``l3_dirs``), with the layout and capacity it
    was created with. FileNotFoundError when it holds no L3; ValueError naming it when damaged."""
    found = stored_layout(directory)
    if found is None:
        raise FileNotFoundError(f"l3.path: no tierkv L3 directory at {Path(directory).expanduser()}")
    return DiskTier(directory, found[0], found[1], direct_io=direct_io, create=False)


def open_each(l3_path: str | Path, direct_io: bool = True) -> list[DiskTier]:
    """Every layout's L3 directory under ``l3_path`` opened as it was created, root first (offline tools)."""
    return [DiskTier(d, lay, cap, direct_io=direct_io, create=False) for d, lay, cap, _ in stored_layouts(l3_path)]


def open_l3(l3_path: str | Path, direct_io: bool = True, layout: str | None = None) -> DiskTier:
    """Open an existing L3 directory with the layout and capacity it was created with.

    ``l3_path`` is an ``l3.path`` (the only layout under it, or the one whose fingerprint starts
    with ``layout``) or one of its ``l3_dirs``. Raises FileNotFoundError naming the path when there
    is no L3 there, ValueError naming the layouts when several are there and ``layout`` is None.
    """
    path = Path(l3_path).expanduser()
    if path.parent.name == LAYOUTS_DIR:
        return open_dir(path, direct_io)
    every = stored_layouts(path)
    picked = [e for e in every if layout is None or e[1].fingerprint.startswith(layout)]
    if not picked:
        which = "" if layout is None else f" of layout {layout}"
        raise FileNotFoundError(f"l3.path: no tierkv L3 directory{which} at {path}")
    if len(picked) > 1:
        raise ValueError(f"l3.path: {path} holds blocks of {len(picked)} layouts ("
                         + "; ".join(f"{e[1].fingerprint} {e[1].dtype}" for e in picked)
                         + "); name one with --layout")
    where, lay, capacity, _ = picked[0]
    return DiskTier(where, lay, capacity, direct_io=direct_io, create=False)


def subtree(records: Sequence[Record], roots: Iterable[bytes]) -> set[bytes]:
    """Keys of ``roots`` and every record that descends from one of them."""
    children: dict[bytes, list[bytes]] = {}
    for rec in records:
        if rec.parent is not None:
            children.setdefault(rec.parent, []).append(rec.key)
    out: set[bytes] = set()
    todo = list(roots)
    while todo:
        key = todo.pop()
        if key in out:
            continue
        out.add(key)
        todo.extend(children.get(key, ()))
    return out


def orphans(records: Sequence[Record]) -> set[bytes]:
    """Keys whose chain is broken: some ancestor is no longer stored, so no lookup can reach them."""
    present = {rec.key for rec in records}
    broken = [rec.key for rec in records if rec.depth > 0 and rec.parent not in present]
    return subtree(records, broken)


def evict(l3: DiskTier, catalog: Catalog, namespaces: set[str], cutoff: float | None = None) -> int:
    """Remove the chains labelled with one of ``namespaces``, or (with ``cutoff``) the blocks
    written before it, together with every block below them. Returns the blocks removed."""
    records = list(l3.records())
    if cutoff is None:
        roots = [k for k, ns in catalog.namespaces().items() if ns in namespaces]
    else:
        roots = [r.key for r in records if r.created < cutoff]
    doomed = subtree(records, roots) & {r.key for r in records}
    l3.remove(sorted(doomed))
    catalog.forget(doomed)
    return len(doomed)


def evict_namespace(l3_path: str | Path, namespace: str) -> int:
    """``evict`` of one namespace in the L3 directory at ``l3_path`` (0 when there is none)."""
    try:
        l3 = open_l3(l3_path)  # no stored_layout() first: each walks the index in a child process
    except FileNotFoundError:
        return 0
    catalog = Catalog(l3_path)
    try:
        return evict(l3, catalog, {namespace})
    finally:
        catalog.close()
        l3.close()
