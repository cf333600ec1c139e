"""Read Prometheus text the way a scraper does (prometheus_client's own parser), for assertions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, frozenset of (label, value))): value}`` for every sample in ``text``."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str | bytes, name: str, **labels: str) -> float | None:
    """The value of one sample, or None when the text has no such sample."""
    return samples(text).get((name, frozenset(labels.items())))


def families(text: str | bytes) -> set[str]:
    """The metric family names in ``text`` (``tierkv_hits``, not ``tierkv_hits_total``)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {family.name for family in text_string_to_metric_families(text)}
