"""The Prometheus text exposition format, read the way the tests need it: every sample keyed by its
name with its labels exactly as exposed (``name{a="b"}``), and sums over label sets."""

from __future__ import annotations

from collections.abc import Mapping


def samples(text: str) -> dict[str, float]:
    """Every sample of a /metrics page: ``'name{labels}'`` (or ``'name'``) -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def unlabelled(text: str) -> dict[str, float]:
    """Only the samples without labels, keyed by name."""
    return {k: v for k, v in samples(text).items() if "{" not in k}


def total(page: Mapping[str, float] | str, name: str) -> float:
    """The sum of every sample of ``name``, whatever its labels (0 when there is none)."""
    found = samples(page) if isinstance(page, str) else page
    return sum(v for k, v in found.items() if k == name or k.startswith(name + "{"))


def value(page: Mapping[str, float] | str, key: str) -> float | None:
    """The one sample ``key`` (name and labels as exposed), or None when the page lacks it."""
    found = samples(page) if isinstance(page, str) else page
    return found.get(key)
