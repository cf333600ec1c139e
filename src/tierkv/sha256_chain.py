"""Chained sha256 block hashes in one native call (the Python loop costs more than the hashing).

``chain(seed, data, n, step)`` returns ``h_i = sha256(h_{i-1} | data[i*step:(i+1)*step])[:16]``
for ``i < n`` with ``h_{-1} = seed`` — exactly ``BlockHasher('sha256')``'s chain — by
calling OpenSSL's low-level SHA-256 from a small C loop (``tierkv.native``). Returns None
when the loop cannot be built or loaded; the caller then hashes in Python.
"""

from __future__ import annotations

import ctypes

from tierkv import native

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* OpenSSL's low-level SHA-256 (libcrypto). The one-shot SHA256() goes through an
   EVP fetch per call in OpenSSL 3 and measured ~0.3 us per small block, this ~0.1 us.
   SHA256_CTX is 112 bytes; an aligned 256-byte buffer stands in for its header. */
int SHA256_Init(void *c);
int SHA256_Update(void *c, const void *data, size_t len);
int SHA256_Final(unsigned char *md, void *c);

int tierkv_sha256_chain(const unsigned char *seed, const unsigned char *data, int64_t n,
                        int64_t step, unsigned char *out) {
  unsigned char ctx[256] __attribute__((aligned(64)));
  unsigned char md[32];
  const unsigned char *prev = seed;
  for (int64_t i = 0; i < n; i++) {
    if (!SHA256_Init(ctx) || !SHA256_Update(ctx, prev, 16) ||
        !SHA256_Update(ctx, data + i * step, (size_t)step) || !SHA256_Final(md, ctx))
      return -1;
    memcpy(out + i * 16, md, 16);
    prev = out + i * 16;
  }
  return 0;
}
"""


def _library() -> ctypes.CDLL | None:
    lib = native.load("sha256_chain", SOURCE, needs=("crypto",))
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
