"""The model identity: everything that changes the KV of a token sequence, named field by field.

A block's key is a chain rooted in a seed (``hashing.py``); the seed binds this
identity's digest, so KV computed under other weights, another rope, another
dtype or another quantization can never be found under these keys (a cache may
lose data; it may never return wrong data). One place computes it for every
entry point: the engine (``engine/loader.py:engine_identity``), ``tierkv
serve`` / ``warm`` / ``why`` through the engine, and the vLLM connector's two
halves (``connectors/vllm/identity.py``). Per-request parts (LoRA adapter,
``cache_salt``) are extra keys of the seed, not fields here.

Each field is a canonical string (JSON with sorted keys for structured
values) and has a short digest, so two identities can say *which* field
differs ("weights 3f2a… → 9c1b…") without printing whole configs.

Weights are hashed in full (xxh3_128 over every byte of every file the model
loads), and each file's digest is remembered in a small JSON cache keyed by
path, device, inode, size, mtime_ns and ctime_ns: a restart with unchanged
weights costs one ``stat`` per file, a file rewritten in place (same size,
same first MiB, as a merged LoRA leaves it) is hashed again.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

UNKNOWN = "unknown"
_CHUNK = 16 << 20
_cache_lock = threading.Lock()


def canonical(value: Any) -> str:
    """A stable text for a field's value: strings as they are, anything else as sorted-key JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def short(text: str) -> str:
    """The 16-hex digest a field is shown by."""
    return xxhash.xxh3_64_hexdigest(text.encode())


@dataclass(frozen=True)
class ModelIdentity:
    """Named fields (sorted by name) whose values fix the KV of every token sequence.

    Immutable and thread-safe. ``digest`` (32 hex) roots the store's seed;
    ``diff`` names the fields in which two identities differ.
    """

    fields: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> ModelIdentity:
        """An identity from ``{field: value}``; values are canonicalised (``canonical``)."""
        for name in values:
            if not isinstance(name, str) or not name:
                raise ValueError(f"identity: field names must be non-empty strings, got {name!r}")
        return cls(tuple(sorted((k, canonical(v)) for k, v in values.items())))

    @classmethod
    def declared(cls, model_id: str, model_revision: str) -> ModelIdentity:
        """The identity a library caller declares through ``StoreConfig.model_id`` / ``model_revision``
        alone: the caller vouches that the name and revision fix the weights."""
        return cls.of({"model_id": model_id, "model_revision": model_revision, "source": "declared"})

    def as_dict(self) -> dict[str, str]:
        return dict(self.fields)

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.as_dict().get(name, default)

    @property
    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(canonical(self.as_dict()).encode())

    def field_digests(self) -> dict[str, str]:
        """``{field: 16-hex digest}``: what ``tierkv info`` prints and L3 records."""
        return {k: short(v) for k, v in self.fields}

    def diff(self, other: ModelIdentity | Mapping[str, str]) -> list[str]:
        """The fields that differ, each as ``"name old… → new…"`` (``other`` is the older one)."""
        mine = self.as_dict()
        theirs = dict(other.fields) if isinstance(other, ModelIdentity) else dict(other)
        out = []
        for name in sorted(set(mine) | set(theirs)):
            a, b = theirs.get(name), mine.get(name)
            if a != b:
                out.append(f"{name} {_show(a)} → {_show(b)}")
        return out

    def to_json(self) -> str:
        return canonical(self.as_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelIdentity:
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"identity: expected a JSON object of strings, got {str(text)[:80]!r}")
        return cls(tuple(sorted(data.items())))


def _show(value: str | None) -> str:
    if value is None:
        return "(absent)"
    if len(value) <= 12 and "\n" not in value:
        return repr(value) if value != value.strip() or not value else value
    return short(value)[:8] + "…"


# -- weights --------------------------------------------------------------------


def digest_cache_path() -> Path:
    """Where file digests are remembered: ``$TIERKV_DIGEST_CACHE`` or ``~/.cache/tierkv/file-digests.json``."""
    env = os.environ.get("TIERKV_DIGEST_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/tierkv/file-digests.json").expanduser()


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_file(path: Path) -> str:
    """xxh3_128 of every byte of ``path`` (32 hex), read in 16 MiB pieces into one buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def file_digests(paths: Iterable[str | os.PathLike], cache: Path | None = None) -> dict[str, tuple[str, bool]]:
    """``{resolved path: (digest, hashed now)}`` for ``paths``, reusing remembered digests whose
    device, inode, size, mtime_ns and ctime_ns still match. Thread-safe within a process; two
    processes racing may each hash a file (the cache file is replaced atomically, last one wins)."""
    cache = cache or digest_cache_path()
    files = [Path(p).resolve() for p in paths]
    with _cache_lock:
        known = _read_cache(cache)
        out: dict[str, tuple[str, bool]] = {}
        dirty = False
        for f in files:
            st = f.stat()
            key, rec = str(f), known.get(str(f))
            if rec is not None and rec.get("stat") == _stat_key(st):
                out[key] = (rec["digest"], False)
                continue
            digest = hash_file(f)
            if _stat_key(f.stat()) != _stat_key(st):  # changed while being read: never remember it
                out[key] = (digest, True)
                continue
            known[key] = {"stat": _stat_key(st), "digest": digest}
            out[key], dirty = (digest, True), True
        if dirty:
            _write_cache(cache, known)
    return out


def checkpoint_files(where: str | os.PathLike) -> list[Path]:
    """The files a loader reads the weights from, for a checkpoint directory or file: safetensors
    shards (from ``model.safetensors.index.json`` when there is one, else every ``*.safetensors``),
    else PyTorch shards (``pytorch_model.bin.index.json``, ``*.bin``, ``*.pt``), else one ``*.gguf``.
    A path to a single file is that file. Raises FileNotFoundError naming the directory."""
    root = Path(where)
    if root.is_file():
        return [root]
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "*.bin")):
        index = root / index_name
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [root / n for n in names]
        found = sorted(root.glob(pattern))
        if found:
            return found
    for pattern in ("*.pt", "*.gguf"):
        found = sorted(root.glob(pattern))
        if found:
            return found
    raise FileNotFoundError(f"model: no checkpoint files (*.safetensors, *.bin, *.pt, *.gguf) in {where}")


def weights_digest(paths: Iterable[str | os.PathLike], cache: Path | None = None) -> str:
    """One digest over the full contents of ``paths`` (order-independent, names not included, so a
    checkpoint copied elsewhere keeps its identity)."""
    digests = sorted(d for d, _ in file_digests(paths, cache).values())
    if not digests:
        raise ValueError("identity: no weight files to hash")
    return xxhash.xxh3_128_hexdigest("|".join(digests).encode())


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir costs a re-hash next start, never a wrong digest


# -- records in L3 meta, snapshots and L4 -----------------------------------------

IDENTITY_PREFIX = "identity:"


def meta_records(identity: ModelIdentity, now: float) -> dict[str, str]:
    """The meta record a store writes for ``identity`` each time it opens an L3 directory."""
    return {IDENTITY_PREFIX + identity.digest: json.dumps({"fields": identity.as_dict(), "seen": round(now, 3)},
                                                          sort_keys=True)}


def recorded(meta: Mapping[str, str]) -> list[tuple[ModelIdentity, float]]:
    """The identities an L3 directory's meta records name, most recently seen first; records that
    do not parse are skipped (advisory: keys, not these records, keep identities apart)."""
    out = []
    for k, v in meta.items():
        if not k.startswith(IDENTITY_PREFIX):
            continue
        try:
            rec = json.loads(v)
            ident = ModelIdentity(tuple(sorted((str(a), str(b)) for a, b in rec["fields"].items())))
            out.append((ident, float(rec.get("seen", 0.0))))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(out, key=lambda r: -r[1])


SALT_PREFIX = "salt:"


def salt_keys(cache_salt: str | None) -> tuple[str, ...]:
    """The seed's extra key for a request's ``cache_salt`` (the same text in the engine and vLLM)."""
    return () if not cache_salt else (SALT_PREFIX + cache_salt,)


def lora_key(name: str, content: str) -> str:
    """The seed's extra key for a LoRA adapter named ``name`` whose files hash to ``content``
    (the vLLM connector's scheduler builds the same text: ``lora:<name>|lora-content:<digest>``)."""
    return f"lora:{name}|lora-content:{content}"


def extra_key_parts(extra_keys: Iterable[str]) -> list[list[str]]:
    """What a seed's extra keys name, in order, safe to record and show: ``["lora", name,
    content digest]``, ``["cache_salt"]`` (that one was set: never the salt, nor a digest of it),
    ``["extra", 16-hex digest]`` for any other key."""
    out = []
    for key in extra_keys:
        if key.startswith(SALT_PREFIX):
            out.append(["cache_salt"])
        elif key.startswith("lora:") and "|lora-content:" in key:
            name, _, content = key[len("lora:"):].rpartition("|lora-content:")
            out.append(["lora", name, content])
        else:
            out.append(["extra", short(key)])
    return out
