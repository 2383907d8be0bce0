"""Notebook 05's hidden tests (instructor edition only): how far the Prefetcher runs ahead, its depth checks and an
error in the iterable."""

from __future__ import annotations

from time import sleep

from course_grader.checks import register
from course_grader.checks.nb05 import as_data, yours


# ---------------------------------------------------------------- Prefetcher
ITEMS = 8  # the iterable of the depth test


def probe_depth(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def how_far_ahead(depth, n=ITEMS):
        produced, ahead = [], []

        def counting():
            for i in range(n):
                produced.append(i)  # the thread has read item i
                yield i
        for k, item in enumerate(Prefetcher(counting(), depth=depth), start=1):
            sleep(0.01)  # a slow step: the thread has time to fill the queue
            ahead.append(len(produced) - k)
        return ahead

    def rejects(depth):
        try:
            Prefetcher(range(3), depth=depth)
        except ValueError:
            return True
        return False

    out = {"ahead": {}}
    for depth in (1, 3):
        out["ahead"][depth] = as_data(yours(ns, lambda: how_far_ahead(depth)))
    out["rejects"] = bool(yours(ns, lambda: rejects(0))) and bool(yours(ns, lambda: rejects(1.5)))
    return out


def judge_depth(got: dict) -> str:
    for depth in (1, 3):
        ahead = got["ahead"][depth]
        assert len(ahead) == ITEMS, f"depth={depth}: the loop got {len(ahead)} items of the iterable's {ITEMS}"
        assert max(ahead) <= depth + 1, (f"depth={depth}: the thread read {max(ahead)} items ahead of the loop; a "
                                         f"queue of {depth} slots allows {depth + 1} "
                                         "(a full queue and the item it holds)")
        assert max(ahead) >= depth, f"depth={depth}: the thread was never more than {max(ahead)} item(s) ahead"
    assert got["rejects"], "depth=0 and depth=1.5 must raise ValueError"
    return "the thread runs depth items ahead and no further; a bad depth is refused"


register("test_Prefetcher_depth", probe_depth, judge_depth)


class CorruptSample(Exception):
    pass


def probe_errors(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def failing():
        yield 0
        yield 1
        raise CorruptSample("sample 2 is corrupt")

    def read_until_error():
        got = []
        try:
            for item in Prefetcher(failing(), depth=2):
                got.append(item)
        except CorruptSample as err:
            return got, str(err)
        return got, None

    got, err = yours(ns, read_until_error, timeout=3.0)
    return {"got": as_data(list(got)), "error": err}


def judge_errors(got: dict) -> str:
    assert got["got"] == [0, 1], f"the items before the failure come first, got {got['got']}"
    assert got["error"] == "sample 2 is corrupt", "the iterable's exception must be raised in the loop"
    return "the iterable's error reaches the loop, after the items before it"


register("test_Prefetcher_errors", probe_errors, judge_errors)
