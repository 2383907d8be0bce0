"""Shared fixtures: execute a solutions notebook once per test session, read what it recorded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# DeepSpeed's CPU op where `make setup` built it (make and .ci/run export this; plain `pytest` gets it here)
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
TIMES: dict[str, float] = {}


@pytest.fixture(scope="session")
def course_run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("course_run")


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU comm op, compiled once before any timed notebook cell would pay for it."""
    from course_lib.zero import build_deepspeed_ops

    build_deepspeed_ops()


@pytest.fixture(scope="session")
def executed(course_run_dir, deepspeed_ops):
    """``executed("02_gradient_accumulation")`` → the results dict that notebook recorded on the CPU tier.

    Each notebook runs once per session (papermill, real kernel); a failing cell fails the test
    with papermill's error naming the cell.
    """
    from course_lib import results
    from course_lib.run_all import execute

    cache: dict[str, dict] = {}

    def run(name: str, tier: str = "cpu") -> dict:
        if name not in cache:
            nb = ROOT / "solutions" / name / f"{name}.ipynb"
            TIMES[name] = execute(nb, course_run_dir, {"tier": tier}, timeout=600)
            cache[name] = results.load(name, course_run_dir)
            cache[name]["seconds"] = TIMES[name]
        return cache[name]

    return run


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


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("notebook execution times (CPU tier, papermill)")
        for name, seconds in TIMES.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
