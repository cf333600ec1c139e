"""Small C helpers built with the system compiler on first use, loaded with ctypes.

Used where a Python loop's per-iteration overhead, not the work, sets the
speed (row-sized block copies, chained hashing of small blocks). Each library
is built once into ``$TIERKV_CACHE_DIR/native`` (default ``~/.cache/tierkv/native``),
keyed by a hash of its source, written to a temp file and renamed, so
concurrent processes are safe. Without a compiler, or with ``TIERKV_NATIVE=0``,
``load`` returns None and callers use their pure-Python or torch path, which
computes the same bytes (tests compare the two).

``load_extension`` builds a CPython extension module the same way (against this
interpreter's headers; the cache key includes its version) for hot paths that
work on Python objects, e.g. the prefix index's per-block loops (``index_native``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("tierkv")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_modules: dict[str, ModuleType | None] = {}


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


def load_extension(name: str, source: str) -> ModuleType | None:
    """The CPython extension module ``name`` built from ``source`` (its init is ``PyInit_<name>``);
    None when unavailable (no compiler or headers, or ``TIERKV_NATIVE=0``). Cached like ``load``."""
    if not enabled():
        return None
    with _lock:
        if name not in _modules:
            _modules[name] = _build_extension(name, source)
        return _modules[name]


def _compile(name: str, source: str, key: str, flags: list[str]) -> Path:
    """``source`` compiled to a shared library in the cache (built once per ``key``)."""
    digest = hashlib.sha256((key + source).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")).expanduser() / "native"
    target = root / f"{name}-{digest}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, "-O3", "-shared", "-fPIC", *flags, "-o", str(out), str(src)],
                           check=True, capture_output=True, timeout=120)
            os.replace(out, target)
    return target


def _build(name: str, source: str, needs: tuple[str, ...]) -> ctypes.CDLL | None:
    try:
        for lib in needs:
            found = ctypes.util.find_library(lib)
            if found is None:
                raise OSError(f"system library {lib!r} not found")
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(str(_compile(name, source, "", [])))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("tierkv: native %s unavailable (%s); using the Python path", name, exc)
        return None


def _build_extension(name: str, source: str) -> ModuleType | None:
    include = sysconfig.get_paths()["include"]
    try:
        if not (Path(include) / "Python.h").exists():
            raise OSError(f"no Python.h in {include}")
        target = _compile(name, source, f"{sys.version}|{include}|", [f"-I{include}"])
        loader = importlib.machinery.ExtensionFileLoader(name, str(target))
        spec = importlib.util.spec_from_file_location(name, str(target), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        log.warning("tierkv: native %s unavailable (%s); using the Python path", name, exc)
        return None
