"""Notebook 07's hidden tests (instructor edition only): BucketedDDP on 3 ranks with a frozen parameter, ranks that
start from different weights, and caps that make one bucket or many."""

from __future__ import annotations

from course_grader.checks import case_seed, peer_port, register
from course_grader.checks.nb07 import (bucketed_probe, check_bucket_rule, check_bucketed, check_wire, play_ddp,
                                       reference_runs, seeded, torch_buckets)
from course_grader.peer import Peer, Wire, rounds


# ---------------------------------------------------------------- BucketedDDP
# The caps: the rule's ends (every parameter in one bucket; buckets of one or two) and one between: fixed, as edges
# are. Rank 0 is the grader's where the buckets fill in torch's order of them (``WIRED``); with tiny buckets a
# GroupNorm's weight fills before its bias, so a rank that sends as they fill and one that sends in torch's order
# (as torch's DDP does, and a reducer that launches after backward) are both right: the student's ranks run alone.
CAPS = ((100.0, "3 ranks, one bucket"), (0.01, "3 ranks, three buckets"), (0.0001, "3 ranks, tiny buckets"))
WIRED = 2  # the first caps' groups have the grader's rank 0


def bucketed_case() -> dict:
    """The weights' and the images' seeds, new to every grading (``case_seed``): rank r starts from ``seed + r``."""
    return {"seed": case_seed("nb07", "bucketed weights"), "data_seed": case_seed("nb07", "bucketed data")}


def play_bucketed(wire: Wire, round: int) -> None:
    """The grader's rank 0 of each cap's group: rank 0's weights (``seed``), three steps of 24 images."""
    case = bucketed_case()
    play_ddp(wire, seeded(case["seed"], True), 24, 3, CAPS[round][0], case["data_seed"], gate=False)


def probe_bucketed(ns: dict) -> list:
    """Ranks 1 and 2 of each wired cap's group (rank 0 is the grader's), then all 3 ranks of the others'."""
    return [bucketed_probe(ns, 2, 24, 3, cap, frozen=True, join=peer_port("test_BucketedDDP_hidden", i),
                           **bucketed_case()) if i < WIRED else
            bucketed_probe(ns, 3, 24, 3, cap, frozen=True, **bucketed_case()) for i, (cap, _) in enumerate(CAPS)]


def judge_bucketed(got: list, wire: list) -> str:
    case = bucketed_case()
    model, per_round = seeded(case["seed"], True), rounds(wire, WIRED)
    want = [{k: 3 * g for k, g in step.items()} for step in reference_runs(3, 24, 3, True, **case)[0]["ddp"]]
    for i, ((cap, label), runs) in enumerate(zip(CAPS, got, strict=True)):
        if i < WIRED:
            check_wire(per_round[i], want, torch_buckets(model, cap), label)
        assert not any("stopped" in run for run in runs), f"{label}: your ranks stopped after their buckets had left"
        check_bucketed(runs, label, 3, 24, 3, True, first=1 if i < WIRED else 0, **case)
        for run in runs:
            assert all(sum(e["what"] == "all_reduce" for e in ev) == run["n_buckets"] for ev in run["events"]), \
                f"{label}: not one all-reduce per bucket in every step"
            assert "head.bias" not in sum(run["buckets"], []), f"{label}: a frozen parameter has no gradient to bucket"
            check_bucket_rule(run["buckets"], model, cap, label)
            assert cap < 1 or run["n_buckets"] == 1, f"{label}: a cap above the model's size makes one bucket"
    return "3 ranks from different weights, a frozen parameter, one bucket and many, each torch's, as rank 0 saw them"


register("test_BucketedDDP_hidden", probe_bucketed, judge_bucketed, Peer(world=3, play=play_bucketed, rounds=WIRED))
