"""Small C helpers built with the system compiler on first use, loaded with ctypes.

Used where a Python loop's per-iteration overhead, not the work, sets the
speed (row-sized block copies, chained hashing of small blocks). Each library
is built once into ``$TIERKV_CACHE_DIR/native`` (default ``~/.cache/tierkv/native``),
keyed by a hash of its source, written to a temp file and renamed, so
concurrent processes are safe. Without a compiler, or with ``TIERKV_NATIVE=0``,
``load`` returns None and callers use their pure-Python or torch path, which
computes the same bytes (tests compare the two).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("tierkv")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get("TIERKV_NATIVE", "1") != "0"


def load(name: str, source: str, needs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``source`` (cached per process and on disk); None when unavailable.

    ``needs`` names system libraries (e.g. ``"crypto"``) whose symbols the source
    calls; they are loaded RTLD_GLOBAL first, so no development package is needed.
    """
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name, source, needs)
        return _loaded[name]


def _build(name: str, source: str, needs: tuple[str, ...]) -> ctypes.CDLL | None:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")).expanduser() / "native"
    target = root / f"{name}-{digest}.so"
    try:
        for lib in needs:
            found = ctypes.util.find_library(lib)
            if found is None:
                raise OSError(f"system library {lib!r} not found")
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
        if not target.exists():
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
                src.write_text(source)
                cc = os.environ.get("CC", "cc")
                subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", str(out), str(src)],
                               check=True, capture_output=True, timeout=120)
                os.replace(out, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("tierkv: native %s unavailable (%s); using the Python path", name, exc)
        return None
