"""Notebook 07's hidden tests (instructor edition only): BucketedDDP on 3 ranks with a frozen parameter, ranks that
start from different weights, and caps that make one bucket or many."""

from __future__ import annotations

from course_grader.checks import case_seed, register
from course_grader.checks.nb07 import bucketed_probe, check_bucket_rule, check_bucketed, seeded


# ---------------------------------------------------------------- BucketedDDP
# The caps are the two ends of the rule (every parameter in one bucket, every parameter alone): fixed, as edges are.
CAPS = ((100.0, "3 ranks, one bucket"), (0.0001, "3 ranks, tiny buckets"))


def bucketed_case() -> dict:
    """The weights' and the images' seeds, new to every grading (``case_seed``): rank r starts from ``seed + r``."""
    return {"seed": case_seed("nb07", "bucketed weights"), "data_seed": case_seed("nb07", "bucketed data")}


def probe_bucketed(ns: dict) -> list:
    return [bucketed_probe(ns, 3, 24, 3, cap, frozen=True, **bucketed_case()) for cap, _ in CAPS]


def judge_bucketed(got: list) -> str:
    case = bucketed_case()
    for (cap, label), runs in zip(CAPS, got, strict=True):
        check_bucketed(runs, label, 3, 24, 3, True, **case)
        for run in runs:
            assert all(sum(e["what"] == "all_reduce" for e in ev) == run["n_buckets"] for ev in run["events"]), \
                f"{label}: not one all-reduce per bucket in every step"
            assert "head.bias" not in sum(run["buckets"], []), f"{label}: a frozen parameter has no gradient to bucket"
            check_bucket_rule(run["buckets"], seeded(case["seed"], True), cap, label)
            assert cap < 1 or run["n_buckets"] == 1, f"{label}: a cap above the model's size makes one bucket"
    return "3 ranks from different weights, a frozen parameter, one bucket and many, each torch's"


register("test_BucketedDDP_hidden", probe_bucketed, judge_bucketed)
