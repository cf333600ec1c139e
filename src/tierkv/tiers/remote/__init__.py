"""L4 remote pool backends, chosen by URL scheme (DESIGN §5)."""

from __future__ import annotations


def open_remote(config, layout, on_failure):
    """The L4 tier for ``config.url``; see issue 6 for the backends."""
    raise ValueError(f"l4.url: no remote backend is built in yet for {config.url!r}")
