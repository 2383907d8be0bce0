"""Notebook 13's hidden tests (instructor edition only): the pair on 4 ranks (rank 0 the grader's), with and without
biases, and sizes that do not divide, and ``CopyToTP`` where its input's gradient also flows around it; the 1F1B
order on other shapes and against torch's plan on 3 stages; the 1F1B executor on 3 ranks (a middle rank receives from
both sides), with fewer micro-batches than stages, and following GPipe's order."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch import nn

import course_lib.parallel.schedules as schedules
from course_grader.checks import case_seed, in_ranks, packed, peer_port, register, tensor_data
from course_grader.checks.nb13 import (PAIR, TP_ANSWERS, as_order, check_first_stage_wire, check_tp_wire,
                                    executor_secret, first_difference, judge_activations, judge_gradients,
                                    judge_orders, judge_tp, order_of, orders, pipeline_runs, play_first_stage,
                                    play_tp, ran, ran_to_the_end, shift_seed, tp_runs)
from course_grader.grading import forbid
from course_grader.peer import Peer, Wire, rounds


def seeds(name: str) -> dict:
    """A case's weights' and inputs' seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb13", name, "weights"), "data_seed": case_seed("nb13", name, "data")}


# ---------------------------------------------------------------- tensor_parallel_pair
def bad_size_rank(ns: dict) -> bytes:
    """Each layer made from a Linear whose 6 features do not divide by the ranks: its ValueError's message, or None."""
    out = []
    for name, layer in (("ColumnParallelLinear", nn.Linear(4, 6)), ("RowParallelLinear", nn.Linear(6, 4))):
        try:
            with forbid(*TP_ANSWERS, namespace=ns):
                ns[name](layer)
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    return packed(out)


def branch_gradient(rank: int, seed: int) -> torch.Tensor:
    """The gradient rank ``rank`` sends into ``CopyToTP(x) + x``: ``seed + rank``'s, different on each rank."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + rank))


def branch_rank(ns: dict, seed: int, data_seed: int) -> bytes:
    """``CopyToTP(x) + x`` backward: autograd hands the one gradient of the sum to both branches, so a backward that
    sums it over the ranks in place changes the other branch's too. The input's gradient on this rank."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(data_seed)).requires_grad_()
    with forbid(*TP_ANSWERS, namespace=ns):
        (ns["CopyToTP"].apply(x) + x).backward(branch_gradient(dist.get_rank(), seed))
    return packed(tensor_data(x.grad))


# The wired rounds: 4 ranks, rank 0 the grader's (label, d, h, bias)
WIRED = (("4 ranks", 8, 16, True), ("4 ranks, no bias", 6, 12, False))


def play_pair(wire: Wire, round: int) -> None:
    label, d, h, bias = WIRED[round]
    play_tp(wire, d, h, bias, shift=shift_seed(f"hidden {label}"), **seeds(label))


def probe_pair(ns: dict) -> dict:
    def strip(runs):
        return [{k: run[k] for k in ("output", "grads")} if "stopped" not in run else run for run in runs]
    return {**{label: strip(tp_runs(ns, 4, d, h, bias, join=peer_port("test_tensor_parallel_pair_hidden", i),
                                    **seeds(label)))
               for i, (label, d, h, bias) in enumerate(WIRED)},
            "bad size": in_ranks(ns, PAIR, bad_size_rank, 4)[0],
            "branch": in_ranks(ns, ("CopyToTP",), branch_rank, 2, **seeds("branch"))}


def judge_pair(got: dict, wire: list) -> str:
    per_round = rounds(wire, len(WIRED))
    for i, (label, d, h, bias) in enumerate(WIRED):
        shift = shift_seed(f"hidden {label}")
        check_tp_wire(per_round[i], label, 4, d, h, bias, shift=shift, **seeds(label))
        judge_tp(got[label], label, 4, d, h, bias, shift=(4, shift), first=1, **seeds(label))
    assert len(got["bad size"]) == 2, f"{len(got['bad size'])} results for the 2 layers of 6 features over 4 ranks"
    for name, msg in zip(("ColumnParallelLinear", "RowParallelLinear"), got["bad size"]):
        assert msg, f"{name}: 6 features over 4 ranks must raise ValueError"
    seed = seeds("branch")["seed"]
    total = branch_gradient(0, seed) + branch_gradient(1, seed)
    assert len(got["branch"]) == 2, f"{len(got['branch'])} ranks answered CopyToTP(x) + x, expected 2"
    for r, grad in enumerate(got["branch"]):
        assert isinstance(grad, torch.Tensor) and grad.shape == total.shape, \
            f"CopyToTP(x) + x, rank {r}: the input's gradient is {grad!r:.80}"
        gap = float((grad - (total + branch_gradient(r, seed))).abs().max())
        assert gap < 1e-5, (f"CopyToTP(x) + x, rank {r}: the input's gradient is off by {gap:.1e}: it must be the sum "
                            "over the ranks (through CopyToTP) plus this rank's own (around it); sum a copy of the "
                            "incoming gradient, not the gradient itself, which autograd also hands to the other branch")
    return "4 ranks, no bias, a ValueError for 6 features over 4 ranks, and CopyToTP beside a branch around it"


register("test_tensor_parallel_pair_hidden", probe_pair, judge_pair,
         Peer(world=4, play=play_pair, rounds=len(WIRED)))

# ---------------------------------------------------------------- one_f_one_b_order
def shapes() -> tuple:
    """(stages, micro-batches): more micro-batches than stages, fewer, and many, new to every grading (``case_seed``);
    and the edges, one micro-batch and one stage."""
    rng = random.Random(case_seed("nb13", "order shapes"))
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
    """1F1B's order (the hidden module's own: course_lib.parallel.schedules' is a stub in the student edition)."""
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
        "p=2, m=4, GPipe": schedules.gpipe_order(2, 4)}


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
