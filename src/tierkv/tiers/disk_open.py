"""Opening an L3 directory safely: take turns, check before mapping, move damage aside (docs/design.md §5).

LMDB maps the index and trusts it: a truncated file kills the reader with SIGBUS, a
garbled page can abort() it on a failed assertion. So before a process maps an index,
``check_before_mapping`` walks it in a child process; only if the child survives is the
file opened. What the checks (here and in ``DiskTier``'s open) find is raised as
``Damaged``; ``open_checked`` then moves ``index/`` and ``slots.bin`` into
``damaged-<UTC time>/`` beside them (never deleting them), reports it once and opens an
empty L3 in their place. Offline openers get a ValueError naming the path instead.
"""

from __future__ import annotations

import ast
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

from tierkv.layout import KVLayout

log = logging.getLogger("tierkv")
# LMDB errors that mean the index file itself is damaged (not a lock, a limit or a permission).
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
          lmdb.IncompatibleError, lmdb.PanicError, lmdb.BadValsizeError)
_PROBE_TIMEOUT_S = 120
_CRASHES = {signal.SIGBUS, signal.SIGSEGV, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}

DamageReport = Callable[[str, int, str], None]  # (reason, blocks lost or 0, detail)


class Damaged(Exception):
    """L3 files that cannot be used as they are: (reason, blocks lost or 0, what is wrong)."""

    def __init__(self, reason: str, lost: int, what: str) -> None:
        super().__init__(what)
        self.reason, self.lost, self.what = reason, lost, what


class DamagedL3(ValueError):
    """What an offline opener (``create=False``, the ``tierkv`` tools) gets for a damaged L3 directory."""


class ForeignLayout(ValueError):
    """An L3 directory that holds blocks of another layout (``theirs``): the store opens that
    layout's own directory instead (``catalog.l3_dir_for``); other openers get this error."""

    def __init__(self, message: str, theirs: KVLayout) -> None:
        super().__init__(message)
        self.theirs = theirs


def damaged_error(path: Path, what: str) -> DamagedL3:
    """The error an offline opener gets for a damaged ``path`` (a ValueError naming ``l3.path``)."""
    return DamagedL3(f"l3.path: {path} is damaged ({what}); a store started on it moves the damaged files aside")


def open_checked(path: Path, attempt: Callable[[], None], create: bool, report: DamageReport) -> None:
    """Run ``attempt`` (open the files under ``path``; raises Damaged) while holding ``path/open.lock``.

    On damage an offline opener (``create=False``) gets ``damaged_error``; otherwise the damaged
    files are moved aside, ``report`` is called once and ``attempt`` runs again on the emptied
    directory. Raises ValueError naming ``l3.path`` when ``path`` cannot be a directory, the files
    cannot be moved, or a fresh L3 is unusable too. Blocks other openers of ``path`` in any process.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = os.open(path / "open.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"l3.path: {path} cannot be the L3 directory ({exc})") from None
    try:
        # Held while checking, moving aside and creating, so that two processes starting on a
        # damaged directory move it once and the second finds the first one's fresh L3.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            attempt()
        except Damaged as damage:
            if not create:
                raise damaged_error(path, damage.what) from None
            report(damage.reason, damage.lost, set_aside(path, damage))
            try:
                attempt()
            except Damaged as again:
                raise ValueError(f"l3.path: a fresh L3 under {path} is unusable ({again.what})") from None
    finally:
        os.close(lock)


def set_aside(path: Path, damage: Damaged) -> str:
    """Move the damaged files under ``path`` into a new ``damaged-<UTC time>`` directory; returns what was done."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    dest, n = path / f"damaged-{stamp}", 1
    try:
        while True:
            try:
                dest.mkdir()
                break
            except FileExistsError:  # a second move within the same second
                n += 1
                dest = path / f"damaged-{stamp}-{n}"
        # The catalog (namespace labels, hit counts) describes the blocks being moved: it goes too.
        for name in ("index", "slots.bin", "catalog"):
            if os.path.lexists(path / name):
                os.rename(path / name, dest / name)
                moved.append(name)
    except OSError as exc:
        raise ValueError(f"l3.path: {path} is damaged ({damage.what}) and its files cannot be "
                         f"moved aside ({exc})") from None
    return f"{path}: {damage.what}; moved {' and '.join(moved)} to {dest}, starting with an empty L3"


def damaged_dirs(path: Path) -> list[Path]:
    """The ``damaged-*`` directories that starts on the L3 directory ``path`` moved files into, by name."""
    return sorted(p for p in path.glob("damaged-*") if p.is_dir() and not p.is_symlink())


def check_before_mapping(path: Path) -> None:
    """Raise Damaged for files under the L3 directory ``path`` that must not be opened as they are:
    ``index``/``slots.bin`` of the wrong file type, an emptied index beside slot data, or an index
    that a child process walking it reports as damaged or dies reading."""
    index, slots = path / "index", path / "slots.bin"
    if slots.exists() and not slots.is_file():
        raise Damaged("damaged_slots", 0, "slots.bin is not a regular file")
    data = index / "data.mdb"
    if index.exists() and (not index.is_dir() or (data.exists() and not data.is_file())):
        raise Damaged("damaged_index", 0, "index is not an LMDB directory")
    if data.is_file() and data.stat().st_size == 0 and has_data(slots):  # LMDB would start it afresh
        raise Damaged("damaged_index", 0, "index/data.mdb is empty but slots.bin holds data")
    _probe_index(index)


def has_data(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def read_count(txn, db, name: bytes, entries: int) -> int:
    """A non-negative integer meta record (0 when absent); Damaged when it is not one."""
    raw = txn.get(name, db=db)
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        value = -1
    if value < 0:
        raise Damaged("damaged_index", entries, f"meta record {name.decode()!r} is unreadable: {raw[:32]!r}")
    return value


def foreign_layout(path: Path, layout: KVLayout, found: bytes, described: bytes | None, entries: int) -> Exception:
    """Another layout's directory (a configuration error), or meta records too damaged to say (Damaged)."""
    try:
        theirs = KVLayout(**ast.literal_eval(described.decode()))
        consistent = theirs.fingerprint.encode() == found
    except (AttributeError, ValueError, TypeError, SyntaxError, RecursionError):
        consistent = False
    if not consistent:
        return Damaged("damaged_index", entries, f"meta records 'layout_fingerprint' {found[:32]!r} and "
                       f"'layout' {(described or b'')[:80]!r} are unreadable or disagree")
    return ForeignLayout(
        f"l3.path: {path} holds blocks of layout {found.decode()} {theirs.to_dict()}, this store's layout is "
        f"{layout.fingerprint} {layout.to_dict()}", theirs)


_PROBE = r"""
import os, sys, lmdb
path = sys.argv[1]
try:
    env = lmdb.open(path, readonly=True, max_dbs=4, subdir=True, lock=True)
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = os.path.getsize(os.path.join(path, "data.mdb"))
    if have < need:
        print(f"index/data.mdb is truncated: {have} bytes, its pages end at byte {need}", file=sys.stderr)
        sys.exit(3)
    with env.begin() as txn:
        for name in (b"blocks", b"free", b"meta"):
            try:
                db = env.open_db(name, txn=txn, create=False)
            except lmdb.NotFoundError:
                continue
            if name == b"blocks":
                print(txn.stat(db)["entries"], flush=True)
            for _ in txn.cursor(db=db):
                pass
except lmdb.Error as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def _probe_index(index: Path) -> None:
    """Walk the LMDB index under ``index`` in a child process; raise Damaged if that fails or kills it."""
    data = index / "data.mdb"
    if not data.is_file() or data.stat().st_size == 0:
        return
    if getattr(sys, "frozen", False) or not Path(sys.executable or "-").name.startswith(("python", "pypy")):
        # A frozen app's executable is the app, not an interpreter: open in-process, as checked as LMDB can.
        log.info("tierkv l3: no Python interpreter to check %s in; opening it unchecked", index)
        return
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE, str(index)], capture_output=True, text=True,
                             timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Damaged("damaged_index", 0, f"walking the index took over {_PROBE_TIMEOUT_S} s") from None
    except OSError as exc:
        log.info("tierkv l3: cannot start the index check (%s); opening %s unchecked", exc, index)
        return
    lines = res.stdout.split()
    lost = int(lines[0]) if lines and lines[0].isdigit() else 0
    why = (res.stderr.strip().splitlines() or [""])[-1]
    if -res.returncode in _CRASHES:  # not SIGTERM or SIGKILL: those come from outside, not from the file
        name = signal.Signals(-res.returncode).name
        raise Damaged("damaged_index", lost, f"reading index/data.mdb killed a process ({name})")
    damage = {cls.__name__ for cls in DAMAGE}
    if res.returncode == 3 or (res.returncode == 2 and why.split(":")[0] in damage):
        raise Damaged("damaged_index", lost, why)
