"""The seeds a store's chains were rooted in under per-request extra keys (LoRA, cache_salt).

A request's extra keys enter its seed (``TierKVStore.seed``), so the same
prompt under another cache_salt or LoRA has other keys for every block, and
nothing in the index says under which. A store that keeps a ``SeedLog``
notes each seed with extra keys it hands out: the seed's bytes, the identity
and namespace it belongs to, and what its extra keys name
(``identity.extra_key_parts``: a LoRA's name and content digest; for a salt,
only that one was set). ``why.explain`` hashes a prompt under each recorded
seed of its identity to say "held under another cache_salt / LoRA".

Kept in ``<L3 directory>/seeds.json`` (the newest ``capacity`` seeds), written
at most once a second on a timer thread and at close, merged with what other
processes wrote there (the vLLM scheduler notes seeds, its worker stores the
blocks). Advisory: a lost record costs an answer of ``why``, never a key.

What it reveals: no salt, nor a digest of one. A seed is a hash of the
salt, as every block key under it is; given a prompt, either lets one test
a guessed salt, so the file holds nothing the L3 index does not.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.identity import extra_key_parts

SEEDS_FILE = "seeds.json"


@dataclass(frozen=True)
class SeedRecord:
    """One noted seed: its bytes, identity digest, namespace, extra-key parts, last noted (UNIX s)."""

    seed: bytes
    identity: str
    namespace: str
    parts: tuple[tuple[str, ...], ...]
    seen: float

    @property
    def salted(self) -> bool:
        return any(p[0] == "cache_salt" for p in self.parts)

    def row(self) -> list:
        return [self.seed.hex(), self.identity, self.namespace, [list(p) for p in self.parts], round(self.seen, 3)]

    @classmethod
    def of_row(cls, row: Sequence) -> SeedRecord:
        seed, ident, ns, parts, seen = row
        return cls(bytes.fromhex(seed), str(ident), str(ns), tuple(tuple(str(x) for x in p) for p in parts),
                   float(seen))


class SeedLog:
    """The newest ``capacity`` seeds with extra keys, saved in ``directory`` (None: kept in memory).

    Thread-safe. ``note`` is cheap (a dict update; the write is a timer's);
    ``close`` writes what is left and stops the timer.
    """

    def __init__(self, directory: str | Path | None, capacity: int = 4096, min_interval: float = 1.0) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.capacity, self.min_interval = capacity, min_interval
        self._log: OrderedDict[bytes, SeedRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._dirty, self._timer, self._last_save = False, None, 0.0
        if self.directory is not None:
            self._merge(self._read())

    def note(self, seed: bytes, identity: str, namespace: str, extra_keys: Sequence[str]) -> None:
        """Record that chains of ``identity`` / ``namespace`` under ``extra_keys`` root in ``seed``."""
        rec = SeedRecord(bytes(seed), identity, namespace, tuple(tuple(p) for p in extra_key_parts(extra_keys)),
                         time.time())
        with self._lock:
            self._put(rec)
            self._dirty = True
            if self.directory is None or self._timer is not None:
                return
            delay = max(0.0, self._last_save + self.min_interval - time.monotonic())
            self._timer = threading.Timer(delay, self._timed_save)
            self._timer.daemon = True
            self._timer.start()

    def records(self, identity: str) -> list[SeedRecord]:
        """The seeds noted for ``identity``, newest first."""
        with self._lock:
            return [r for r in reversed(self._log.values()) if r.identity == identity]

    def __len__(self) -> int:
        return len(self._log)

    def save(self) -> None:
        """Write the log merged with the file's (newest wins) to ``seeds.json``, atomically; errors
        are ignored (advisory)."""
        if self.directory is None:
            return
        with self._save_lock:
            with self._lock:
                self._dirty = False
            self._merge(self._read())
            with self._lock:
                rows = [r.row() for r in self._log.values()]
            try:
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=SEEDS_FILE + ".")
                with os.fdopen(fd, "w") as fh:
                    json.dump({"version": 1, "seeds": rows}, fh)
                os.replace(tmp, self.directory / SEEDS_FILE)
            except OSError:
                pass
            self._last_save = time.monotonic()

    def close(self) -> None:
        """Stop the timer and write what is not written yet."""
        with self._lock:
            timer, self._timer = self._timer, None
            dirty = self._dirty
        if timer is not None:
            timer.cancel()
        if dirty:
            self.save()

    def _timed_save(self) -> None:
        with self._lock:
            self._timer = None
        self.save()

    def _read(self) -> list[SeedRecord]:
        try:
            data = json.loads((self.directory / SEEDS_FILE).read_text())
            return [SeedRecord.of_row(row) for row in data["seeds"]]
        except (OSError, ValueError, TypeError, KeyError):
            return []

    def _merge(self, records: list[SeedRecord]) -> None:
        with self._lock:
            for rec in records:
                mine = self._log.get(rec.seed)
                if mine is None or mine.seen < rec.seen:
                    self._put(rec)
            ordered = sorted(self._log.values(), key=lambda r: r.seen)
            self._log = OrderedDict((r.seed, r) for r in ordered[-self.capacity:])

    def _put(self, rec: SeedRecord) -> None:
        self._log.pop(rec.seed, None)
        self._log[rec.seed] = rec
        while len(self._log) > self.capacity:
            self._log.popitem(last=False)
