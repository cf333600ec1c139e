"""The prefix index's per-block loops in C, on the index's own Python objects (``tierkv.native``).

A replay or a store spends its time in loops that do a little work per block:
the lookup's pin and touch (``PrefixIndex.use``), a save (``save_chain``), the
release (``unpin``), the trim (``evict``: victims, their drops and the parents
they expose) and the ranking calls those make into ``lru`` and ``hit_density``
(their ``AgeQueue``s, ``hit_density``'s scoring, ghosts and learning hooks).
``tierkv/_native/index.c`` (built and loaded here through ``tierkv.native``)
is a C translation of exactly those Python methods, statement for statement,
reading and writing the same objects (``Entry`` slots, the queues'
dicts of deques and key heaps, the policy's histograms and ghosts), so the
Python and C paths can interleave freely and decide the same: the index calls
it when it is available and falls back to its Python code otherwise
(``TIERKV_NATIVE=0``, no compiler or Python headers); tests compare the two.
Every other policy (``cost_aware``, ``lfu``, the replay's oracle) is called
through its Python methods, once per listing change, as before.

Owns nothing: called by ``PrefixIndex`` under the caller's lock (not thread-safe,
like the index). Floating point is computed in the same order as the Python
code, with no fused multiply-adds, so results are bit-identical.
"""

from __future__ import annotations

from types import ModuleType

from tierkv import native


_module: ModuleType | None = None
_tried = False
_setup = None  # registered by tierkv.policy: hands the module the index's and policies' classes


def set_setup(fn) -> None:
    """Register ``fn(module)``, which gives the built module the classes and constants it works on.
    tierkv.policy registers it when imported (it imports tierkv.index; this module imports neither,
    so no import cycle); every index has a policy, so it is registered before any index loads us."""
    global _setup
    _setup = fn


def load() -> ModuleType | None:
    """The C hot path, built and set up on first call; None when unavailable (the Python path then runs)."""
    global _module, _tried
    if not _tried:
        _tried = True
        mod = native.load_extension("_tierkv_index", "index.c")
        if mod is not None and _setup is not None:
            _setup(mod)
            _module = mod
    return _module
