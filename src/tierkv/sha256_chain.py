"""Chained sha256 block hashes in one native call (the Python loop costs more than the hashing).

``chain(seed, data, n, step)`` returns ``h_i = sha256(h_{i-1} | data[i*step:(i+1)*step])[:16]``
for ``i < n`` with ``h_{-1} = seed`` — exactly ``BlockHasher('sha256')``'s chain — by
calling OpenSSL's low-level SHA-256 from a small C loop (``tierkv/_native/sha256_chain.c``,
built by ``tierkv.native``). Returns None when the loop cannot be built or loaded; the
caller then hashes in Python.
"""

from __future__ import annotations

import ctypes

from tierkv import native


def _library() -> ctypes.CDLL | None:
    lib = native.load("sha256_chain", needs=("crypto",))
    if lib is not None and lib.tierkv_sha256_chain.argtypes is None:
        fn = lib.tierkv_sha256_chain
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p]
    return lib


def available() -> bool:
    return _library() is not None


def chain(seed: bytes, data: bytes, n: int, step: int, start: int = 0) -> list[bytes] | None:
    """Hashes of blocks ``start .. start+n`` of ``data`` chained from ``seed``; None if unavailable."""
    lib = _library()
    if lib is None:
        return None
    if len(seed) != 16 or (start + n) * step > len(data):
        raise ValueError("sha256 chain: seed must be 16 bytes and data must hold every block")
    out = ctypes.create_string_buffer(16 * n)
    view = data if start == 0 else data[start * step:]
    if lib.tierkv_sha256_chain(seed, view, n, step, out) != 0:
        return None
    raw = out.raw
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]
