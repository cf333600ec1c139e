"""Replies to pipelined Redis GETs, read from the socket with each payload landing in the caller's block.

redis-py (with hiredis or without) reads a bulk reply into its own buffer
and then builds a ``bytes`` object from it: two copies of every 512 KiB
block before tierkv's own copy into the destination. ``ReplyReader`` reads
the RESP2 framing itself and ``recv_into``s the payload straight into the
destination, so the kernel's copy out of the socket is the only one.
It only parses what GET returns (bulk strings, nulls, errors; RESP2 and RESP3).
"""

from __future__ import annotations

import socket

from tierkv.tiers.remote.base import RemoteUnavailable
from tierkv.tiers.remote.codec import TRAILER_BYTES

ERROR = -2  # ``bulk`` length for an error reply to one command (e.g. WRONGTYPE)
_CRLF = b"\r\n"


class ReplyReader:
    """Reads consecutive GET replies from one connected socket. Not thread-safe: one per call.

    Raises OSError (timeouts included) when the socket fails and
    RemoteUnavailable when the server sends something GET never returns.
    """

    def __init__(self, sock: socket.socket, scratch: int = 64 << 10) -> None:
        self.sock = sock
        self.buf = bytearray(scratch)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0

    def _fill(self) -> None:
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):
            n = self.end - self.pos
            if n == len(self.buf):
                raise RemoteUnavailable(f"a reply line longer than {len(self.buf)} bytes")
            self.buf[:n] = self.buf[self.pos:self.end]
            self.pos, self.end = 0, n
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise ConnectionError("the server closed the connection mid-reply")
        self.end += got

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(_CRLF, self.pos, self.end)
            if i >= 0:
                line = bytes(self.buf[self.pos:i])
                self.pos = i + 2
                return line
            self._fill()

    def _into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes into ``dst``: what is buffered first, then straight from the socket."""
        k = min(len(dst), self.end - self.pos)
        dst[:k] = self.view[self.pos:self.pos + k]
        self.pos += k
        while k < len(dst):
            got = self.sock.recv_into(dst[k:])
            if not got:
                raise ConnectionError("the server closed the connection mid-value")
            k += got

    def bulk(self, payload: memoryview) -> tuple[int, bytes]:
        """The next GET reply: ``(length, tail)`` as ``RemoteBackend.read_into`` returns them.

        A value of at most ``len(payload) + TRAILER_BYTES`` bytes leaves its
        first ``length - TRAILER_BYTES`` bytes (the block, or a compressed
        block) at the start of ``payload`` and its trailer in ``tail``; a
        larger one is read whole (``payload`` untouched) and ``tail`` is its
        last bytes. Length -1 is a missing key, ``ERROR`` an error reply.
        """
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            length = int(line[1:])
            if length < 0:
                return -1, b""
            if TRAILER_BYTES <= length <= len(payload) + TRAILER_BYTES:
                self._into(payload[:length - TRAILER_BYTES])
                tail = bytearray(TRAILER_BYTES + 2)
                self._into(memoryview(tail))
            else:
                tail = bytearray(length + 2)
                self._into(memoryview(tail))
            if tail[-2:] != _CRLF:
                raise RemoteUnavailable("a bulk reply not terminated by CRLF")
            return length, bytes(tail[-2 - TRAILER_BYTES:-2] if length >= TRAILER_BYTES else tail[:-2])
        if kind == b"_":  # RESP3 null (redis-py 8 speaks RESP3 when the server does)
            return -1, b""
        if kind in (b"-", b"!"):  # simple or (RESP3) blob error: not an error of the pool
            if kind == b"!":
                self._into(memoryview(bytearray(int(line[1:]) + 2)))
            return ERROR, line[1:]
        raise RemoteUnavailable(f"unexpected reply to GET: {line[:40]!r}")
