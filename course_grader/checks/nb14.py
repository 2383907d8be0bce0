"""Notebook 14's visible tests: the tensor-parallel pair on 2 forked ranks (its output, gradients and collectives),
with the grader's own rank as rank 0."""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import course_lib.parallel.tp as tp
import torch.nn.functional as F

from course_grader.checks import (case_seed, in_ranks, number, packed, peer_port, plain, register, student,
                                  tensor_data)
from course_grader.grading import forbid
from course_grader.peer import Peer, Wire, join_ranks
from course_lib.distributed import CollectiveBytes

# What the exercise builds, out of reach while the student's code runs.
TP_ANSWERS = (tp.copy_to_tp, tp.reduce_from_tp, tp.gather_from_tp, tp.ColumnParallelLinear, tp.RowParallelLinear,
              tp.parallelize_mlp, parallelize_module, ColwiseParallel, RowwiseParallel)
PAIR = ("ColumnParallelLinear", "RowParallelLinear")


# ---------------------------------------------------------------- tensor_parallel_pair
def mlp(d: int = 8, h: int = 16, bias: bool = True, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, h, bias=bias), nn.GELU(), nn.Linear(h, d, bias=bias))


def tp_mlp(d: int, h: int, bias: bool, seed: int = 0, shift: tuple[int, int] | None = None) -> nn.Sequential:
    """``mlp(d, h, bias, seed)``; with ``shift=(world, s)``, rank 0's part of the pair (the column layer's first
    h / world rows, the row layer's first h / world columns) moved by noise drawn from ``s``: the weights of a group
    whose rank 0 is the grader's, which reach the student's ranks only through the pair's two all-reduces."""
    model = mlp(d, h, bias, seed)
    if shift is not None:
        n, g = h // shift[0], torch.Generator().manual_seed(shift[1])
        with torch.no_grad():
            for part in (model[2].weight[:n], model[4].weight[:, :n]) + ((model[2].bias[:n],) if bias else ()):
                part += 0.5 * torch.randn(part.shape, generator=g)
    return model


def mlp_input(d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(6, d, generator=torch.Generator().manual_seed(seed))


def tp_rank(d: int, h: int, bias: bool, ns: dict, seed: int = 0, data_seed: int = 1) -> dict:
    """One rank: a replicated Linear, then the student's column- and row-parallel layers made from the unsplit MLP's
    (the weights of ``seed``, the input of ``data_seed``); their output, the gradients of every weight (this rank's
    slice) and of the input, and the collectives."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ref = mlp(d, h, bias, seed)
    mine = copy.deepcopy(ref)
    x = mlp_input(d, data_seed).requires_grad_(True)
    with forbid(*TP_ANSWERS, namespace=ns):
        mine[2], mine[4] = ns["ColumnParallelLinear"](ref[2]), ns["RowParallelLinear"](ref[4])
        with CollectiveBytes() as comm:
            out = mine(x)
            forward_calls = dict(comm.calls_by_kind)
            out.pow(2).sum().backward()
    grads = {"first layer": mine[0].weight.grad, "column weight": mine[2].weight.grad,
             "row weight": mine[4].weight.grad, "input": x.grad}
    if bias:
        grads.update({"column bias": mine[2].bias.grad, "row bias": mine[4].bias.grad})
    return packed(plain({"output": tensor_data(out), "grads": {k: tensor_data(g) for k, g in grads.items()},
                   "forward calls": {str(k): number(v) for k, v in forward_calls.items()},
                   "calls": {str(k): number(v) for k, v in comm.calls_by_kind.items()},
                   "bytes": {str(k): number(v) for k, v in comm.bytes_by_kind.items()}}))


def tp_runs(ns: dict, world: int, d: int, h: int, bias: bool, seed: int = 0, data_seed: int = 1,
            join: int | None = None) -> list:
    """``tp_rank`` on ``world`` forked ranks; with ``join`` (the port of the grader's rank 0, ``peer_port``) on ranks 1
    to ``world - 1`` of a group whose rank 0 is the grader's (``play_tp``)."""
    if join is None:
        return in_ranks(ns, PAIR, tp_rank, world, d=d, h=h, bias=bias, seed=seed, data_seed=data_seed)
    rank = functools.partial(tp_rank, ns=student(ns, *PAIR))
    return join_ranks(rank, world - 1, dict(d=d, h=h, bias=bias, seed=seed, data_seed=data_seed), port=join)


def reference(d: int, h: int, bias: bool, seed: int = 0, data_seed: int = 1,
              shift: tuple[int, int] | None = None) -> tuple[torch.Tensor, dict]:
    """The unsplit MLP's (``tp_mlp``'s) output and its full gradients, in one process; "pair input" is the gradient
    of the pair's input, "pair sum" the row layer's output before its bias."""
    ref = tp_mlp(d, h, bias, seed, shift)
    x = mlp_input(d, data_seed).requires_grad_(True)
    pair_input = ref[1](ref[0](x))
    pair_input.retain_grad()
    pair_sum = F.linear(ref[3](ref[2](pair_input)), ref[4].weight)
    out = pair_sum if ref[4].bias is None else pair_sum + ref[4].bias
    out.pow(2).sum().backward()
    grads = {"first layer": ref[0].weight.grad, "column weight": ref[2].weight.grad, "row weight": ref[4].weight.grad,
             "input": x.grad}
    if bias:
        grads.update({"column bias": ref[2].bias.grad, "row bias": ref[4].bias.grad})
    grads.update({"pair input": pair_input.grad, "pair sum": pair_sum.detach()})
    return out.detach(), grads


def rank_slice(name: str, g: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's part of the unsplit gradient ``g``: rows of the column layer, columns of the row layer's weight."""
    if name in ("column weight", "column bias"):
        return g[rank * n:(rank + 1) * n]
    if name == "row weight":
        return g[:, rank * n:(rank + 1) * n]
    return g


def judge_tp(runs: list, label: str, world: int, d: int, h: int, bias: bool, seed: int = 0,
             data_seed: int = 1, shift: tuple[int, int] | None = None, first: int = 0) -> None:
    """The student's ranks ``first`` to ``world - 1`` (rank 0 the grader's where ``first`` is 1): output and gradients
    against the unsplit MLP's."""
    want, full = reference(d, h, bias, seed, data_seed, shift)
    del full["pair input"], full["pair sum"]
    assert not any("stopped" in run for run in runs), \
        f"{label}: your ranks stopped after rank 0's all-reduces: {runs[0].get('stopped', '')[-120:]}"
    assert len(runs) == world - first, f"{label}: {len(runs)} ranks answered, expected {world - first}"
    n = h // world
    for r, run in enumerate(runs, start=first):
        assert isinstance(run["output"], torch.Tensor), \
            f"{label}, rank {r}: the output is {run['output']}, not a tensor"
        gap = float((run["output"] - want).abs().max())
        assert gap < 1e-5, (f"{label}, rank {r}: the output differs from the unsplit MLP's by "
                            f"{gap:.1e}: is the bias added once, after the all-reduce?")
        for name, g_full in full.items():
            g, ref_g = run["grads"][name], rank_slice(name, g_full, r, n)
            assert g is not None, (f"{label}, rank {r}: the {name} got no gradient: a collective without a "
                                   "backward cut the graph (use your autograd functions)")
            assert isinstance(g, torch.Tensor), f"{label}, rank {r}: the {name}'s gradient is {g}, not a tensor"
            rel = float((g - ref_g).abs().max() / ref_g.abs().max())
            assert rel < 1e-5, (f"{label}, rank {r}: the {name}'s gradient is off by {rel:.1e} (relative): "
                                "CopyToTP's backward must sum the input's gradient over the ranks")


# ---------------------------------------------------------------- the pair, as the grader's rank 0 sees it
# Rank 0 of a wired group is the grader's: it holds its own part of the pair, moved by noise drawn at grading
# (``tp_mlp``'s shift), so the student's ranks give the right output and gradients only from what the all-reduces
# brought. It plays the contract's two collectives: the all-reduce of the row layer's partial outputs (g, forward),
# then the all-reduce of the partial gradients of the pair's input (f, backward), and records each sum.
def shift_seed(name: str) -> int:
    """The seed of rank 0's shifted part in check ``name``: new to every grading (``case_seed``)."""
    return case_seed("nb14", name, "rank 0's weights")


def play_tp(wire: Wire, d: int, h: int, bias: bool, seed: int, data_seed: int, shift: int) -> None:
    """Rank 0's side of ``tp_rank`` (the grader's), its part of ``tp_mlp(d, h, bias, seed, (world, shift))``."""
    world = dist.get_world_size()
    n, ref = h // world, tp_mlp(d, h, bias, seed, (world, shift))
    column, row = ref[2], ref[4]
    pair_input = ref[1](ref[0](mlp_input(d, data_seed))).detach().requires_grad_()
    column_part = F.linear(pair_input, column.weight[:n], None if column.bias is None else column.bias[:n])
    partial = F.linear(ref[3](column_part), row.weight[:, :n])
    total = partial.detach().clone()
    dist.all_reduce(total)
    wire.record("forward", sum=total.clone())
    partial.backward(2 * (total if row.bias is None else total + row.bias.detach()))
    summed = pair_input.grad.clone()
    dist.all_reduce(summed)
    wire.record("backward", sum=summed.clone())


def check_tp_wire(events: list, label: str, world: int, d: int, h: int, bias: bool, seed: int, data_seed: int,
                  shift: int, sums: bool = True) -> None:
    """What reached the grader's rank 0 is the unsplit MLP's: the row layer's output before its bias (forward), then
    the gradient of the pair's input (backward), each summed over the ranks. ``sums=False``: the two all-reduces, of
    those shapes, whatever they summed."""
    _, full = reference(d, h, bias, seed, data_seed, (world, shift))
    got = {e["what"]: e["sum"] for e in events if e["what"] in ("forward", "backward")}
    for what, key, where in (("forward", "pair sum", "the row-parallel layer's partial outputs (g, in forward)"),
                             ("backward", "pair input", "the partial gradients of the column-parallel layer's input "
                                                        "(f, in backward)")):
        if what not in got:
            hint = "" if what == "backward" else ": the forward makes one, after the row layer's matmul, bias not added"
            raise AssertionError(f"{label}: the grader's rank 0 all-reduced {where}, {tuple(full[key].shape)} values, "
                                 f"and your rank's collective there did not match{hint}")
        want, values = full[key], got[what]
        assert values.shape == want.shape, f"{label}: {where} all-reduced as {tuple(values.shape)}"
        if not sums:
            continue
        gap = float((values - want).abs().max()) / (float(want.abs().max()) + 1e-12)
        hint = (": the pair's one all-reduce in forward sums the row layer's matmuls, its bias added once after it "
                "(f is the identity in forward)" if what == "forward" else "")
        assert gap < 1e-5, (f"{label}: the all-reduce of {where} reached the grader's rank 0 as another sum than the "
                            f"unsplit MLP's (max rel. diff {gap:.1e}){hint}")


def play_pair(wire: Wire, round: int) -> None:
    """Rank 0 of ``test_tensor_parallel_pair``: the MLP of seed 0, d=8, h=16, 2 ranks."""
    play_tp(wire, 8, 16, True, 0, 1, shift_seed("test_tensor_parallel_pair"))


def probe_pair(ns: dict) -> list:
    return [{k: run[k] for k in ("output", "grads")} if "stopped" not in run else run
            for run in tp_runs(ns, 2, 8, 16, True, join=peer_port("test_tensor_parallel_pair"))]


def judge_pair(runs: list, wire: list) -> str:
    shift = shift_seed("test_tensor_parallel_pair")
    check_tp_wire(wire, "2 ranks", 2, 8, 16, True, 0, 1, shift)
    judge_tp(runs, "2 ranks", 2, 8, 16, True, shift=(2, shift), first=1)
    return "2 ranks, rank 0 the grader's: the unsplit MLP's sums reached it, and your rank's output and gradients"


register("test_tensor_parallel_pair", probe_pair, judge_pair, Peer(world=2, play=play_pair))


# ---------------------------------------------------------------- tensor_parallel_pair: its collectives
def play_collectives(wire: Wire, round: int) -> None:
    play_tp(wire, 8, 16, True, 0, 1, shift_seed("test_tensor_parallel_pair_collectives"))


def probe_collectives(ns: dict) -> list:
    return [{k: run[k] for k in ("forward calls", "calls", "bytes")} if "stopped" not in run else run
            for run in tp_runs(ns, 2, 8, 16, True, join=peer_port("test_tensor_parallel_pair_collectives"))]


def judge_collectives(runs: list, wire: list) -> str:
    """The wire first (rank 0's record: an all-reduce of the pair's output in forward, one of its input's gradient in
    backward; what they summed is the pair test's), then the rank's own count of its calls and bytes, for what rank 0
    cannot see (an extra collective after them)."""
    check_tp_wire(wire, "2 ranks", 2, 8, 16, True, 0, 1, shift_seed("test_tensor_parallel_pair_collectives"),
                  sums=False)
    assert not any("stopped" in run for run in runs), "your rank stopped after rank 0's all-reduces"
    assert len(runs) == 1, f"{len(runs)} ranks answered, expected 1"
    for r, run in enumerate(runs, start=1):
        assert run["forward calls"] == {"all_reduce": 1}, (f"rank {r}: forward ran {run['forward calls']}: the pair "
                                                           "needs one all-reduce, after the row-parallel layer")
        assert run["calls"] == {"all_reduce": 2}, f"rank {r}: forward and backward ran {run['calls']}"
        assert run["bytes"] == {"all_reduce": 2 * 6 * 8 * 4}, f"rank {r}: {run['bytes']} bytes"
    return f"one all-reduce forward, one backward, of {6 * 8 * 4} bytes each"


register("test_tensor_parallel_pair_collectives", probe_collectives, judge_collectives,
         Peer(world=2, play=play_collectives))
