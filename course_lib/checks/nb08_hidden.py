"""Notebook 08's hidden tests (instructor edition only): the pair on 4 ranks, without biases, and sizes that do not
divide; the 1F1B order on other shapes and against torch's plan on 3 stages."""

from __future__ import annotations

from torch import nn

from course_lib.checks import register
from course_lib.checks.nb08 import TP_ANSWERS, as_order, in_ranks, judge_orders, judge_tp, order_of, orders, ran, tp_runs
from course_lib.grading import forbid


# ---------------------------------------------------------------- tensor_parallel_pair
def bad_size_rank(rank: int, world: int, ns: dict) -> list:
    """Each layer made from a Linear whose 6 features do not divide by the ranks: its ValueError's message, or None."""
    out = []
    for name, layer in (("ColumnParallelLinear", nn.Linear(4, 6)), ("RowParallelLinear", nn.Linear(6, 4))):
        try:
            with forbid(*TP_ANSWERS, namespace=ns):
                ns[name](layer)
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    return out


def probe_pair(ns: dict) -> dict:
    strip = lambda runs: [{k: run[k] for k in ("output", "grads")} for run in runs]
    return {"4 ranks": strip(tp_runs(ns, 4, 8, 16, True)), "no bias": strip(tp_runs(ns, 2, 6, 12, False)),
            "bad size": in_ranks(ns, bad_size_rank, 4)[0]}


def judge_pair(got: dict) -> str:
    judge_tp(got["4 ranks"], "4 ranks", 4, 8, 16, True)
    judge_tp(got["no bias"], "2 ranks, no bias", 2, 6, 12, False)
    for msg in got["bad size"]:
        assert msg, "6 features over 4 ranks must raise ValueError"
    return "4 ranks, no bias, and a ValueError for 6 features over 4 ranks"


register("test_tensor_parallel_pair_hidden", probe_pair, judge_pair)

# ---------------------------------------------------------------- one_f_one_b_order
SHAPES = ((3, 5), (4, 2), (5, 1), (3, 9), (1, 3))


def probe_order(ns: dict) -> dict:
    return {"shapes": orders(ns, SHAPES), "3,3": order_of(ns, 3, 3)}


def judge_order(got: dict) -> str:
    judge_orders(got["shapes"], SHAPES)
    torch_order = ran(3, 3, 3, 6)
    assert as_order(got["3,3"]) == torch_order, f"p=3, m=3: your order {as_order(got['3,3'])}\ntorch ran {torch_order}"
    return "other shapes, fewer micro-batches than stages, and torch's order on 3 stages"


register("test_one_f_one_b_order_hidden", probe_order, judge_order)
