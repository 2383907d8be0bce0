"""What an executed notebook recorded, read by the tests of that notebook: values, claims, step-by-step lists.

``executed(name)`` (tests/conftest.py) runs a notebook once per session and returns its results dict; these read it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def value(res: dict, name: str):
    """A recorded value from a results dict."""
    return res["values"][name]["value"]


def claim(res: dict, start: str) -> dict:
    """The one claim a notebook recorded whose text starts with ``start``."""
    found = [c for c in res["claims"] if c["claim"].startswith(start)]
    assert len(found) == 1, f"expected one claim starting {start!r}, got {[c['claim'] for c in res['claims']]}"
    return found[0]


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two equally long lists of numbers (losses step by step)."""
    assert len(a) == len(b), f"{len(a)} values against {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
