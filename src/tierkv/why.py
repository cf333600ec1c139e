"""Why a prompt's blocks hit or missed: per block, the tier that holds it or the reason it is not there.

``explain(store, keys)`` answers for one chain of block keys (``store.hash``
of a prompt, or the connector's keys): each block is

- ``held`` in a tier (the fastest local tier the index names, else L4);
- ``evicted`` from a tier at a time (``EvictionLog``: the last tier it left,
  seen by this process or by an earlier one that closed the same L3);
- ``damaged``: a read of it failed its checksum (or its tier failed) and it
  was dropped;
- ``other_identity``: not under this model identity, but the block computed
  for the same tokens under an identity the L3 directory records is there —
  the fields that differ are named ("weights 3f2a… → 9c1b…");
- ``other_request_keys``: held under this identity but another request's
  extra keys — another cache_salt, another LoRA (name, or content
  "a1b2… → c3d4…"), none where this one has some. The chain is recomputed
  under every seed the store's ``SeedLog`` (``seeds.py``) noted for this
  identity, and under the plain seed; a seed is tried past the prompt's
  first block only where that block is held under it. Salted seeds are
  looked under only with ``other_salts`` (an operator's question: a
  cache_salt exists so that one tenant cannot learn what another computed,
  so a server answering any client leaves it off); the salt is never shown;
- ``not_computed``: no tier has it and nothing says it was ever there.

Read-only and thread-safe (index reads under the store's lock; the L4
membership probe outside it).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierkv.identity import SALT_PREFIX, extra_key_parts, lora_key, recorded
from tierkv.index import Tier
from tierkv.metrics import TIER_NAMES

EVICTION_LOG_FILE = "evictions.json"


class EvictionLog:
    """The last tier each recently removed block left, and when; at most ``capacity`` blocks.

    A ``TierEvents`` listener (``by_tier``): a block stored anywhere leaves the
    log, a block removed from a tier enters it (the newest removal wins), so
    a block not in any tier was evicted from the tier the log names. ``note``
    records a block dropped for a reason (``damaged``). Thread-safe. ``save`` /
    ``load`` keep it across processes in the L3 directory (``evictions.json``).
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._log: OrderedDict[bytes, tuple[int, float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, stored: list[list[bytes]], removed: list[list[bytes]]) -> None:
        now = time.time()
        with self._lock:
            for tier, keys in enumerate(removed):
                for key in keys:
                    key = bytes(key)
                    old = self._log.get(key)
                    if old is not None and old[2] != "evicted" and old[0] == tier:
                        continue  # the removal of a block noted as damaged there: keep the reason
                    self._put(key, (tier, now, "evicted"))
            for keys in stored:
                for key in keys:
                    self._log.pop(bytes(key), None)

    def note(self, key: bytes, tier: int, reason: str) -> None:
        """Record that ``tier`` dropped ``key`` for ``reason`` (``damaged``)."""
        with self._lock:
            self._put(bytes(key), (int(tier), time.time(), reason))

    def _put(self, key: bytes, rec: tuple[int, float, str]) -> None:
        self._log.pop(key, None)
        self._log[key] = rec
        while len(self._log) > self.capacity:
            self._log.popitem(last=False)

    def get(self, key: bytes) -> tuple[int, float, str] | None:
        with self._lock:
            return self._log.get(bytes(key))

    def __len__(self) -> int:
        return len(self._log)

    def save(self, directory: str | Path) -> None:
        """Write the log to ``directory/evictions.json`` (atomically); errors are ignored (advisory)."""
        with self._lock:
            rows = [[k.hex(), t, round(w, 3), r] for k, (t, w, r) in self._log.items()]
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=EVICTION_LOG_FILE + ".")
            with os.fdopen(fd, "w") as fh:
                json.dump(rows, fh)
            os.replace(tmp, Path(directory) / EVICTION_LOG_FILE)
        except OSError:
            pass

    def load(self, directory: str | Path) -> None:
        """Add what an earlier process saved in ``directory`` (older than anything recorded here)."""
        try:
            rows = json.loads((Path(directory) / EVICTION_LOG_FILE).read_text())
            older = OrderedDict((bytes.fromhex(k), (int(t), float(w), str(r))) for k, t, w, r in rows)
        except (OSError, ValueError, TypeError):
            return
        with self._lock:
            for k, rec in self._log.items():
                older.pop(k, None)
                older[k] = rec
            self._log = older
            while len(self._log) > self.capacity:
                self._log.popitem(last=False)


@dataclass(frozen=True)
class BlockWhy:
    """One block's answer: ``status`` one of held, evicted, damaged, other_identity,
    other_request_keys, not_computed."""

    block: int
    tokens: tuple[int, int]
    key: str
    status: str
    tier: str | None = None
    at: float | None = None
    identity: str | None = None
    differs: tuple[str, ...] = field(default_factory=tuple)

    def describe(self, now: float | None = None) -> str:
        if self.status == "held":
            return f"in {self.tier}"
        if self.status in ("evicted", "damaged"):
            ago = (now or time.time()) - (self.at or 0.0)
            return f"{self.status} from {self.tier} {ago:.0f} s ago"
        if self.status == "other_identity":
            return f"held under identity {self.identity[:12]}, which differs in: " + "; ".join(self.differs)
        if self.status == "other_request_keys":
            return f"held in {self.tier} under another request's extra keys: " + "; ".join(self.differs)
        return "not computed yet (no tier has it, no eviction of it recorded)"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens"], d["differs"] = list(self.tokens), list(self.differs)
        return {k: v for k, v in d.items() if v not in (None, [])}


def explain(store, token_ids: Sequence[int], namespace: str | None = None,
            extra_keys: Sequence[str] = (), other_salts: bool = False) -> list[BlockWhy]:
    """Per full block of ``token_ids`` (hashed as ``store.hash`` does), where it is or why it is not;
    ``other_salts``: also under the seeds of requests that set a cache_salt (module docstring)."""
    bs = store.block_size
    # An explicit identity: the seed is computed as store.hash would, and not noted in its SeedLog.
    keys = store.hasher.hash_blocks(list(token_ids), bs, store.seed(namespace, extra_keys, identity=store.identity))
    found = _where(store, keys)
    others = [ident for ident, _ in store.recorded_identities() if ident.digest != store.identity.digest]
    elsewhere: dict[int, tuple[object, list[str]]] = {}
    missing = [i for i, t in enumerate(found) if t is None]
    for ident in others:
        if not missing:
            break
        seed = store.seed(namespace, extra_keys, identity=ident)
        theirs = store.hasher.hash_blocks(list(token_ids), bs, seed)
        where = _where(store, [theirs[i] for i in missing])
        for i, tier in zip(list(missing), where):
            if tier is not None:
                elsewhere[i] = (ident, store.identity.diff(ident))
                missing.remove(i)
    if missing:
        elsewhere.update(_other_layouts(store, token_ids, namespace, extra_keys, missing))
    missing = [i for i in missing if i not in elsewhere]
    other_keys = _other_request_keys(store, token_ids, namespace, extra_keys, missing, other_salts) if missing else {}
    log = getattr(store, "evictions", None)
    out = []
    for i, key in enumerate(keys):
        base = dict(block=i, tokens=(i * bs, (i + 1) * bs), key=key.hex())
        if found[i] is not None:
            out.append(BlockWhy(status="held", tier=TIER_NAMES[found[i]], **base))
        elif i in elsewhere:
            ident, differs = elsewhere[i]
            out.append(BlockWhy(status="other_identity", identity=ident.digest, differs=tuple(differs), **base))
        elif i in other_keys:
            tier, differs = other_keys[i]
            out.append(BlockWhy(status="other_request_keys", tier=TIER_NAMES[tier], differs=tuple(differs), **base))
        elif log is not None and (rec := log.get(key)) is not None:
            tier, at, reason = rec
            out.append(BlockWhy(status=reason, tier=TIER_NAMES[tier], at=at, **base))
        else:
            out.append(BlockWhy(status="not_computed", **base))
    return out


def _other_layouts(store, token_ids: Sequence[int], namespace: str | None, extra_keys: Sequence[str],
                   missing: list[int]) -> dict[int, tuple[object, list[str]]]:
    """Blocks ``missing`` here that an L3 directory of another layout under the same ``l3.path``
    holds (another dtype), under one of the identities it records: block -> (identity, fields differing)."""
    from tierkv.catalog import open_dir, other_layouts

    l3 = store.tiers.get(Tier.L3)
    found: dict[int, tuple[object, list[str]]] = {}
    for where, layout, meta in other_layouts(store.config.l3.path, l3.path if l3 is not None else None):
        todo = [i for i in missing if i not in found]
        if not todo or layout.block_size != store.block_size:
            continue
        try:
            disk = open_dir(where)
        except (OSError, ValueError):  # gone or damaged since listed: nothing to say about it
            continue
        try:
            for ident, _ in recorded(meta):
                theirs = store.hasher.hash_blocks(list(token_ids), store.block_size,
                                                  store.seed(namespace, extra_keys, identity=ident, layout=layout))
                for i, there in zip(todo, disk.contains([theirs[i] for i in todo])):
                    if there and i not in found:  # a declared identity may name no dtype: the layout does
                        found[i] = (ident, store.identity.diff(ident) or [_layout_diff(layout, store.layout)])
        finally:
            disk.close()
    return found


def _layout_diff(theirs, mine) -> str:
    if theirs.dtype != mine.dtype:
        return f"layout dtype {theirs.dtype} → {mine.dtype}"
    return f"layout {theirs.fingerprint[:8]}… → {mine.fingerprint[:8]}…"


def _other_request_keys(store, token_ids: Sequence[int], namespace: str | None, extra_keys: Sequence[str],
                        missing: list[int], other_salts: bool) -> dict[int, tuple[int, list[str]]]:
    """Blocks ``missing`` here that this identity holds, in this namespace, under other extra keys:
    the plain seed's chain and each ``SeedLog`` seed's (salted ones with ``other_salts`` only),
    tried in full where the prompt's first block is held under it. Block -> (tier, differs)."""
    ident, bs, ids = store.identity, store.block_size, list(token_ids)
    ns = store.config.namespace if namespace is None else namespace
    own = store.seed(namespace, extra_keys, identity=ident)
    tries: list[tuple[bytes, tuple]] = [(store.seed(namespace, (), identity=ident), ())] if extra_keys else []
    log = getattr(store, "seed_log", None)
    if log is not None:
        tries += [(r.seed, r.parts) for r in log.records(ident.digest)
                  if r.seed != own and r.namespace == ns and (other_salts or not r.salted)]
    if not tries or len(ids) < bs:
        return {}
    firsts = [store.hasher.hash_blocks(ids[:bs], bs, seed)[0] for seed, _ in tries]
    found: dict[int, tuple[int, list[str]]] = {}
    for (seed, parts), first in zip(tries, _where(store, firsts)):
        todo = [i for i in missing if i not in found]
        if first is None or not todo:
            continue
        chain = store.hasher.hash_blocks(ids[: (max(todo) + 1) * bs], bs, seed)
        for i, tier in zip(todo, _where(store, [chain[i] for i in todo])):
            if tier is not None:
                found[i] = (tier, _keys_diff(store, namespace, extra_keys, seed, parts))
    return found


def _keys_diff(store, namespace: str | None, extra_keys: Sequence[str], their_seed: bytes,
               theirs: tuple) -> list[str]:
    """How the extra keys under ``their_seed`` (recorded as ``theirs``) differ from ``extra_keys``:
    the LoRA by name or content digest, the salt only as set, unset or another one."""
    mine = [tuple(p) for p in extra_key_parts(extra_keys)]
    theirs = [tuple(p) for p in theirs]
    out = []
    a, b = (next((p for p in parts if p[0] == "lora"), None) for parts in (theirs, mine))
    if a != b:
        if a is None or b is None or a[1] != b[1]:
            out.append(f"LoRA {a[1] if a else '(none)'} → {b[1] if b else '(none)'}")
        else:
            out.append(f"LoRA {b[1]} content {a[2][:8]}… → {b[2][:8]}…")
    salted = [any(p[0] == "cache_salt" for p in parts) for parts in (theirs, mine)]
    if salted == [True, False]:
        out.append("cache_salt set → (none)")
    elif salted == [False, True]:
        out.append("cache_salt (none) → set")
    elif salted == [True, True]:
        same = _same_salt(store, namespace, extra_keys, their_seed, theirs)
        if same is None:
            out.append("cache_salt set in both (the same one or another: not known)")
        elif not same:
            out.append("cache_salt another one → this one")
    if [p for p in theirs if p[0] == "extra"] != [p for p in mine if p[0] == "extra"]:
        out.append("other extra keys")
    return out or ["the extra keys' order"]


def _same_salt(store, namespace: str | None, extra_keys: Sequence[str], their_seed: bytes,
               theirs: list[tuple]) -> bool | None:
    """Whether ``their_seed`` was salted with this request's salt: their extra keys rebuilt with it
    give their seed again. None when a key of theirs cannot be rebuilt (only its digest is kept)."""
    salt = next(k for k in extra_keys if k.startswith(SALT_PREFIX))
    rebuilt = []
    for p in theirs:
        if p[0] == "extra":
            return None
        rebuilt.append(lora_key(p[1], p[2]) if p[0] == "lora" else salt)
    return store.seed(namespace, rebuilt, identity=store.identity) == their_seed


def _where(store, keys: Sequence[bytes]) -> list[int | None]:
    """Per key: the fastest local tier the index names, else L4 when the pool holds it, else None."""
    with store._lock:
        found = []
        for key in keys:
            entry = store.index.get(key)
            found.append(int(entry.best) if entry is not None and entry.mask else None)
    l4 = store.tiers.get(Tier.L4)
    if l4 is not None:
        todo = [i for i, t in enumerate(found) if t is None]
        if todo:
            for i, there in zip(todo, l4.contains([keys[i] for i in todo])):
                if there:
                    found[i] = int(Tier.L4)
    return found


def summary(blocks: Sequence[BlockWhy]) -> dict[str, int]:
    """``{status: blocks}`` over ``blocks``."""
    out: dict[str, int] = {}
    for b in blocks:
        out[b.status] = out.get(b.status, 0) + 1
    return out
