"""Notebook 15's hidden tests (instructor edition only): the 1F1B order on other shapes and against torch's plan on
3 stages; the 1F1B executor on 3 ranks (a middle rank receives from both sides), with fewer micro-batches than
stages, and following GPipe's order (rank 0, stage 0, the grader's)."""

from __future__ import annotations

import random


import course_lib.parallel.pp as pp
from course_grader.checks import case_seed, peer_port, register
from course_grader.checks.nb15 import (as_order, check_first_stage_wire, executor_secret, first_difference,
                                    judge_activations, judge_gradients, judge_orders, order_of, orders,
                                    pipeline_runs, play_first_stage, ran, ran_to_the_end)
from course_grader.peer import Peer, Wire, rounds


def seeds(name: str) -> dict:
    """A case's weights' and inputs' seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb15", name, "weights"), "data_seed": case_seed("nb15", name, "data")}


# ---------------------------------------------------------------- one_f_one_b_order
def shapes() -> tuple:
    """(stages, micro-batches): more micro-batches than stages, fewer, and many, new to every grading (``case_seed``);
    and the edges, one micro-batch and one stage."""
    rng = random.Random(case_seed("nb14", "order shapes"))
    more, fewer, many = rng.randint(2, 5), rng.randint(3, 6), rng.randint(2, 4)
    return ((more, rng.randint(more + 1, 2 * more)), (fewer, rng.randint(1, fewer - 1)),
            (many, rng.randint(3 * many, 4 * many)), (5, 1), (1, 3))


def probe_order(ns: dict) -> dict:
    # p=3, m=3 is compared with the order torch ran on 3 real ranks, measured once: fixed
    return {"shapes": orders(ns, shapes()), "3,3": order_of(ns, 3, 3)}


def judge_order(got: dict) -> str:
    judge_orders(got["shapes"], shapes())
    differs = first_difference(as_order(got["3,3"]), ran(3, 3, 3, 6))
    assert differs is None, f"p=3, m=3: your order is not the one torch's Schedule1F1B ran: {differs}"
    return "other shapes, fewer micro-batches than stages, and torch's order on 3 stages"


register("test_one_f_one_b_order_hidden", probe_order, judge_order)


# ---------------------------------------------------------------- run_1f1b
def one_f_one_b(p: int, m: int) -> list:
    """1F1B's order (the hidden module's own: course_lib.parallel.pp's is a stub in the student edition)."""
    plan = []
    for r in range(p):
        warmup = min(m, p - r)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("B", i), ("F", warmup + i)]
        plan.append(order + [("B", i) for i in range(m - warmup, m)])
    return plan


# 3 ranks (a middle rank receives from both sides), fewer micro-batches than stages, and GPipe's order (m held);
# rank 0 of each is the grader's
RUNS = {"p=3, m=5, 1F1B": one_f_one_b(3, 5), "p=3, m=2, 1F1B": one_f_one_b(3, 2),
        "p=2, m=4, GPipe": pp.gpipe_order(2, 4)}


def play_runs(wire: Wire, round: int) -> None:
    label, plan = list(RUNS.items())[round]
    play_first_stage(wire, plan[0], **seeds(label), secret=executor_secret(label))


def probe_runs(ns: dict) -> dict:
    got = {}
    for i, (label, plan) in enumerate(RUNS.items()):
        got[label] = run = pipeline_runs(ns, plan, **seeds(label), join=peer_port("test_run_1f1b_hidden", i))
        if "ranks" not in run:  # a deadlock deadlocks again: the judge reports the first
            break
    return got


def judge_runs(got: dict, wire: list) -> str:
    for (label, plan), events in zip(RUNS.items(), rounds(wire, len(RUNS))):
        ran_to_the_end(got[label], label, events)
        check_first_stage_wire(events, label, len(plan), plan[0], **seeds(label), secret=executor_secret(label))
        judge_gradients(got[label], len(plan), len(plan[0]) // 2, label, **seeds(label),
                        secret=executor_secret(label), first=1)
        judge_activations(got[label], plan, label, first=1)
    return ("3 ranks, fewer micro-batches than stages, and GPipe's order (m in flight), rank 0 the grader's: right "
            "gradients and counts")


register("test_run_1f1b_hidden", probe_runs, judge_runs,
         Peer(world=tuple(len(plan) for plan in RUNS.values()), play=play_runs, rounds=len(RUNS)))
