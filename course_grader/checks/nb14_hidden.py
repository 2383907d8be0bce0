"""Notebook 14's hidden tests (instructor edition only): the pair on 4 ranks (rank 0 the grader's), with and without
biases, and sizes that do not divide, and ``CopyToTP`` where its input's gradient also flows around it; the 1F1B
order on other shapes and against torch's plan on 3 stages; the 1F1B executor on 3 ranks (a middle rank receives from
both sides), with fewer micro-batches than stages, and following GPipe's order."""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from course_grader.checks import case_seed, in_ranks, packed, peer_port, register, tensor_data
from course_grader.checks.nb14 import (PAIR, TP_ANSWERS, check_tp_wire,
                                    judge_tp, play_tp, shift_seed, tp_runs)
from course_grader.grading import forbid
from course_grader.peer import Peer, Wire, rounds


def seeds(name: str) -> dict:
    """A case's weights' and inputs' seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb14", name, "weights"), "data_seed": case_seed("nb14", name, "data")}


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
