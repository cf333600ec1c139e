"""A wake-up one thread sets for another without waking it now: what lets a batch fill cheaply.

``Alarm.arm(delay)`` makes the thread blocked in ``wait`` return ``delay``
seconds from now; ``fire`` makes it return now. On Linux this is a timerfd
(``timerfd_create(2)``): arming is one syscall that wakes nobody, the kernel
wakes the waiter once, when the time comes, and ``wait`` is a blocking read.
So a batch that fills for a window costs its delivery thread one wake, where
a lock rung at the first record and a timed wait after it cost two, each
with its GIL handover in the middle of the caller's work.

Elsewhere (no timerfd in libc) a pair of locks stands in: ``arm`` wakes the
waiter at once and it sleeps out the delay itself, as before.

Thread-safety: ``arm`` and ``fire`` from any thread, ``wait`` from one. They
never release the GIL (``ctypes.PyDLL``), so a caller holding a lock under
the GIL is not switched out by arming. A later ``arm`` or ``fire`` replaces
the time an earlier one set. ``wait`` may return early (a stale expiry); its
caller checks what there is to do. The descriptor is closed when the alarm
is collected, never while anyone can still arm it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

_CLOCK_MONOTONIC = 1
_KEPT_SPECS = 256  # timespecs an alarm keeps, one per delay it was armed with; others are built per call


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc_timerfd():
    """(timerfd_create, timerfd_settime) from libc, called with the GIL held; None off Linux."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        return libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None


_TIMERFD = _libc_timerfd()


def _spec(delay: float) -> _Itimerspec:
    ns = max(int(delay * 1e9), 1)  # an it_value of 0 would disarm the timer
    return _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))


class TimerAlarm:
    """The Linux alarm: one timerfd."""

    def __init__(self) -> None:
        create, self._settime = _TIMERFD
        fd = create(_CLOCK_MONOTONIC, os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._fd = fd
        self._specs: dict[float, tuple[_Itimerspec, object]] = {}  # delay -> (struct, its byref)
        self._now = self._ref(0.0)
        weakref.finalize(self, os.close, fd)

    def _ref(self, delay: float):
        spec = self._specs.get(delay)
        if spec is None:
            struct = _spec(delay)
            spec = (struct, ctypes.byref(struct))  # (the byref keeps its struct alive)
            if len(self._specs) < _KEPT_SPECS:
                self._specs[delay] = spec
        return spec[1]

    def arm(self, delay: float) -> None:
        if self._settime(self._fd, 0, self._ref(delay), None):
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def fire(self) -> None:
        if self._settime(self._fd, 0, self._now, None):
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def wait(self) -> None:
        os.read(self._fd, 8)  # the expiry count; blocks (GIL released) until the timer has fired


class LockAlarm:
    """The portable alarm: ``arm`` wakes the waiter now, which then sleeps out the delay."""

    def __init__(self) -> None:
        # Binary semaphores, held while nobody rings them: _bell wakes the waiter, _hurry ends a delay.
        self._bell, self._hurry = threading.Lock(), threading.Lock()
        self._bell.acquire()
        self._hurry.acquire()
        self._delay = 0.0

    def arm(self, delay: float) -> None:
        self._delay = delay
        _ring(self._bell)

    def fire(self) -> None:
        self._delay = 0.0
        _ring(self._hurry)
        _ring(self._bell)

    def wait(self) -> None:
        self._hurry.acquire(False)  # a fire from before this wait: its bell (and delay 0) still stand
        self._bell.acquire()
        if self._delay > 0:
            self._hurry.acquire(timeout=self._delay)


def Alarm() -> TimerAlarm | LockAlarm:  # noqa: N802 (a factory that reads as the type it makes)
    """A timerfd alarm where the platform has one, else the lock-based one."""
    if _TIMERFD is not None:
        try:
            return TimerAlarm()
        except OSError:
            pass
    return LockAlarm()


def _ring(bell: threading.Lock) -> None:
    """Release a binary semaphore; ringing one already rung changes nothing."""
    try:
        bell.release()
    except RuntimeError:
        pass
