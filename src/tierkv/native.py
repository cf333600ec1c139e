"""Small C helpers built with the system compiler on first use, loaded with ctypes.

Used where a Python loop's per-iteration overhead, not the work, sets the
speed (row-sized block copies, chained hashing of small blocks). The sources
are real C files shipped as package data in ``tierkv/_native/`` (no C inside a
``.py``). Each library is built once into ``$TIERKV_CACHE_DIR/native`` (default
``~/.cache/tierkv/native``), keyed by a hash of its source, the compiler (its
resolved path, size and mtime) and the flags, written to a temp file and
renamed, so concurrent processes are safe and a changed compiler or flag
rebuilds. Every build uses ``FLAGS`` (``-ffp-contract=off``: no fused
multiply-adds, with GCC and clang alike). Without a compiler, or with
``TIERKV_NATIVE=0``, ``load`` returns None and callers use their pure-Python
or torch path, which computes the same bytes (tests compare the two).

``load_extension`` builds a CPython extension module the same way (against this
interpreter's headers; the cache key includes its version) for hot paths that
work on Python objects, e.g. the prefix index's per-block loops (``index_native``).
Thread-safe: one build per name per process, under a lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
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
SOURCES = Path(__file__).resolve().parent / "_native"
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")


def enabled() -> bool:
    return os.environ.get("TIERKV_NATIVE", "1") != "0"


def source(file: str) -> str:
    """The text of ``tierkv/_native/<file>`` (a C source shipped with the package)."""
    return (SOURCES / file).read_text()


def load(name: str, needs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``tierkv/_native/<name>.c`` (cached per process and on disk); None
    when unavailable.

    ``needs`` names system libraries (e.g. ``"crypto"``) whose symbols the source
    calls; they are loaded RTLD_GLOBAL first, so no development package is needed.
    """
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name, f"{name}.c", needs)
        return _loaded[name]


def load_extension(name: str, file: str) -> ModuleType | None:
    """The CPython extension module ``name`` built from ``tierkv/_native/<file>`` (its init is ``PyInit_<name>``);
    None when unavailable (no compiler or headers, or ``TIERKV_NATIVE=0``). Cached like ``load``."""
    if not enabled():
        return None
    with _lock:
        if name not in _modules:
            _modules[name] = _build_extension(name, file)
        return _modules[name]


def _compiler(cc: str) -> str:
    """What identifies the compiler ``cc`` in the cache key: its resolved path, size and mtime."""
    found = shutil.which(cc)
    if found is None:
        raise OSError(f"no C compiler {cc!r} on PATH (CC)")
    real = os.path.realpath(found)
    st = os.stat(real)
    return f"{real}|{st.st_size}|{st.st_mtime_ns}"


def _compile(name: str, source: str, key: str, flags: list[str]) -> Path:
    """``source`` compiled to a shared library in the cache (built once per source, ``key``, compiler and flags)."""
    cc = os.environ.get("CC", "cc")
    argv = [*FLAGS, *flags]
    digest = hashlib.sha256("|".join([key, _compiler(cc), *argv, source]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")).expanduser() / "native"
    target = root / f"{name}-{digest}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            subprocess.run([cc, *argv, "-o", str(out), str(src)],
                           check=True, capture_output=True, timeout=120)
            os.replace(out, target)
    return target


def _build(name: str, file: str, needs: tuple[str, ...]) -> ctypes.CDLL | None:
    try:
        for lib in needs:
            found = ctypes.util.find_library(lib)
            if found is None:
                raise OSError(f"system library {lib!r} not found")
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(str(_compile(name, source(file), "", [])))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("tierkv: native %s unavailable (%s); using the Python path", name, exc)
        return None


def _build_extension(name: str, file: str) -> ModuleType | None:
    include = sysconfig.get_paths()["include"]
    try:
        if not (Path(include) / "Python.h").exists():
            raise OSError(f"no Python.h in {include}")
        target = _compile(name, source(file), f"{sys.version}|{include}|", [f"-I{include}"])
        loader = importlib.machinery.ExtensionFileLoader(name, str(target))
        spec = importlib.util.spec_from_file_location(name, str(target), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        log.warning("tierkv: native %s unavailable (%s); using the Python path", name, exc)
        return None
