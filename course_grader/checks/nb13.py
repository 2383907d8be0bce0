"""Notebook 13's visible tests: the tensor-parallel pair on 2 forked ranks (its output, gradients and collectives),
the 1F1B order (simulated, and against the order torch's Schedule1F1B ran on 2 ranks, which no message prints), and
the executor on 2 forked ranks following a given order that is not 1F1B's (one process's losses and gradients; the
micro-batches it holds, counted and measured)."""

from __future__ import annotations

import copy
import functools
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import course_lib.parallel.pp as pp
import course_lib.parallel.schedules as schedules
import course_lib.parallel.tp as tp
import torch.nn.functional as F

from course_grader.checks import (case_seed, in_ranks, number, packed, peer_port, plain, register, student,
                                  tensor_data, unpacked)
from course_grader.grading import forbid, worst
from course_grader.peer import Peer, Wire, join_ranks
from course_lib.distributed import CollectiveBytes
from course_lib.launch import run_forked

# What each exercise builds, out of reach while the student's code runs.
TP_ANSWERS = (tp.copy_to_tp, tp.reduce_from_tp, tp.gather_from_tp, tp.ColumnParallelLinear, tp.RowParallelLinear,
              tp.parallelize_mlp, parallelize_module, ColwiseParallel, RowwiseParallel)
PP_ANSWERS = (schedules.one_f_one_b_order, schedules.gpipe_order, schedules.torch_order, Schedule1F1B, ScheduleGPipe)
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
    return case_seed("nb13", name, "rank 0's weights")


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


# ---------------------------------------------------------------- one_f_one_b_order
def action(a) -> tuple:
    """One action of the student's order as plain data: its strings kept, its numbers as numbers."""
    return tuple(x if isinstance(x, str) else number(x) for x in a)


def order_of(ns: dict, p: int, m: int) -> list:
    """The student's ``one_f_one_b_order(p, m)``, the library's orders and torch's schedules forbidden."""
    with forbid(*PP_ANSWERS, namespace=ns):
        order = ns["one_f_one_b_order"](p, m)
    return [[action(a) for a in rank] for rank in order]


def orders(ns: dict, shapes) -> dict:
    return {f"{p},{m}": order_of(ns, p, m) for p, m in shapes}


def as_order(order) -> list:
    return [[tuple(a) for a in rank] for rank in order]


def check_order(order: list, p: int, m: int) -> None:
    order = as_order(order)
    assert len(order) == p, f"p={p}, m={m}: {len(order)} ranks' orders, expected {p}"
    everything = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
    for r, actions in enumerate(order):
        assert sorted(actions) == everything, \
            f"p={p}, m={m}, rank {r}: every F and B of every micro-batch once: {actions}"
        alive = peak = 0
        for kind, _ in actions:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak <= p - r, (f"p={p}, m={m}, rank {r} keeps {peak} micro-batches in flight; 1F1B keeps at most "
                               f"p - r = {p - r}: start the backwards after the warm-up")
    try:
        sim = schedules.schedule_makespan(order, t_f=1.0, t_b=2.0)
    except ValueError as err:
        raise AssertionError(f"p={p}, m={m}: the order cannot run: {err}") from None
    formula = schedules.bubble_formula(p, m)
    assert abs(sim["bubble"] - formula) < 1e-9, \
        f"p={p}, m={m}: simulated bubble {sim['bubble']:.3f}, 1F1B's is {formula:.3f}"


def judge_orders(got: dict, shapes) -> None:
    for p, m in shapes:
        check_order(got[f"{p},{m}"], p, m)


SHAPES = ((2, 4), (4, 4), (4, 8))

register("test_one_f_one_b_order", lambda ns: orders(ns, SHAPES),
         lambda got: judge_orders(got, SHAPES) or "runnable, at most p - r in flight, bubble (p-1)/(m+p-1)")


# ---------------------------------------------------------------- one_f_one_b_order: what torch ran
def measured_rank(m: int, layers: int, batch: int) -> list:
    warnings.filterwarnings("ignore")
    res = pp.train(schedule="1f1b", microbatches=m, steps=1, layers=layers, batch=batch, seq=8, seed=0)
    return schedules.rank_orders(res["timeline"])


@functools.lru_cache(maxsize=None)
def torch_ran(p: int, m: int, layers: int, batch: int) -> tuple:
    """The order torch's Schedule1F1B ran on p real ranks (one step), per rank: measured here, in the grader."""
    ranks = run_forked(measured_rank, p, dict(m=m, layers=layers, batch=batch), timeout=45)[0]
    return tuple(tuple(tuple(a) for a in rank) for rank in ranks)


def ran(p: int, m: int, layers: int, batch: int) -> list:
    return as_order(torch_ran(p, m, layers, batch))


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def first_difference(mine: list, theirs: list) -> str | None:
    """Where the student's order first leaves the order torch ran, in words (one action of each, never the whole
    order: it is the exercise's answer); None where they are the same."""
    if len(mine) != len(theirs):
        return f"your order lists {len(mine)} ranks, the schedule runs {len(theirs)} stages"
    def said(actions: list, i: int) -> str:
        return "".join(map(str, actions[i])) if i < len(actions) else "nothing (its actions ended)"

    for r, (a, b) in enumerate(zip(mine, theirs)):
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                return f"stage {r}'s {ordinal(i + 1)} action: you have {said(a, i)}, the schedule runs {said(b, i)}"
    return None


def judge_measured(got: list) -> str:
    differs = first_difference(as_order(got), ran(2, 4, 2, 8))
    assert differs is None, f"p=2, m=4: your order is not the one torch's Schedule1F1B ran: {differs}"
    return "the order torch's Schedule1F1B ran on 2 ranks, 4 micro-batches, action for action"


register("test_one_f_one_b_order_measured", lambda ns: order_of(ns, 2, 4), judge_measured)


# ---------------------------------------------------------------- run_1f1b
# p stages of an MLP of constant width: every activation between stages is one (ROWS, WIDTH) tensor
ROWS, WIDTH = 4, 16
PIPE_TIMEOUT = 10  # seconds: the right executor takes a few milliseconds here; a deadlock never ends
PIPE_ANSWERS = PP_ANSWERS + (schedules.run_1f1b, pp.naive_step, pp.train, PipelineStage)
# The order the visible executor tests give, 2 stages and 4 micro-batches: runnable, and neither GPipe's nor 1F1B's
# (rank 0 runs three forwards ahead, rank 1 two at a time: 3 and 2 micro-batches held), so an executor must follow
# the order it is given; its first exchange is 1F1B's (rank 0 sends an activation while rank 1 sends a gradient back),
# where blocking sends deadlock.
GIVEN_2_4 = [[("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)],
             [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("F", 2), ("F", 3), ("B", 2), ("B", 3)]]


class CountedStage(nn.Module):
    """Linear then tanh, which tells ``counter`` each time a forward begins (by any way of calling it)."""

    def __init__(self, counter: "InFlight"):
        super().__init__()
        self.linear, self.counter = nn.Linear(WIDTH, WIDTH), counter

    def forward(self, x):
        self.counter.forwards += 1
        return torch.tanh(self.linear(x))


def pipeline_stages(p: int, counter: "InFlight | None" = None, seed: int = 0, secret: int | None = None) -> list:
    """The ``p`` stages of ``seed``; with ``secret``, stage 0's weights drawn from it instead: the stage of the
    grader's rank 0, whose activations reach the student's ranks only over the wire."""
    torch.manual_seed(seed)
    stages = [CountedStage(counter or InFlight()) for _ in range(p)]
    if secret is not None:
        g = torch.Generator().manual_seed(secret)
        with torch.no_grad():
            for q in stages[0].linear.parameters():
                q.copy_((torch.rand(q.shape, generator=g) * 2 - 1) / WIDTH ** 0.5)
    return stages


def micro_batches(m: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)) for _ in range(m)]


def mse(out, target):
    return (out - target).pow(2).mean()  # saves out - target only: a fresh tensor of this micro-batch


class InFlight:
    """The most micro-batches whose activations were alive at once on this rank: every tensor autograd saves
    during the stage's k-th forward (and the loss after it) counts for that forward until the tensor is freed,
    by backward or by the last reference the executor kept. Weights and the micro-batches' data do not count."""

    def __init__(self, keep=()):
        self.keep = {t.untyped_storage().data_ptr() for t in keep}
        self.forwards, self.alive, self.peak = 0, {}, 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.keep:
            k = self.forwards
            self.alive[k] = self.alive.get(k, 0) + 1
            self.peak = max(self.peak, len(self.alive))
            weakref.finalize(t, self.release, k)
        return t

    def release(self, k: int) -> None:
        self.alive[k] -= 1
        if not self.alive[k]:
            del self.alive[k]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def pipeline_rank(orders: list, ns: dict, seed: int = 0, data_seed: int = 1) -> bytes:
    """One rank of the student's ``run_1f1b`` on its stage (the weights of ``seed``), following ``orders[rank]`` on
    the micro-batches of ``data_seed``: the losses and peak it reports, the in-flight peak measured beside it, and its
    stage's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counter = InFlight()
    stage, data = pipeline_stages(world, counter, seed)[rank], micro_batches(len(orders[rank]) // 2, data_seed)
    counter.keep |= {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *(t for pair in data for t in pair)]}
    order = [tuple(a) for a in orders[rank]]  # a right order, given: this exercise is the executor, not the order
    with forbid(*PIPE_ANSWERS, namespace=ns), counter.hooks():
        result = ns["run_1f1b"](stage, rank, world, data, order, mse, (ROWS, WIDTH))
    losses, peak = result if isinstance(result, (tuple, list)) and len(result) == 2 else (repr(result)[:200], None)
    return packed(plain({"losses": [number(x) for x in losses] if isinstance(losses, (list, tuple)) else losses,
                         "peak": number(peak), "in flight": counter.peak,
                         "grads": [tensor_data(q.grad) for q in (stage.linear.weight, stage.linear.bias)]}))


def pipeline_runs(ns: dict, orders: list, seed: int = 0, data_seed: int = 1, join: int | None = None) -> dict:
    """The student's executor on one forked rank per order (with ``join``, the port of the grader's rank 0: on ranks
    1 to p - 1 only), or the timeout it ran into (a deadlock, as data)."""
    space = student(ns, "run_1f1b")
    rank = functools.partial(pipeline_rank, ns=space)
    kwargs = dict(orders=orders, seed=seed, data_seed=data_seed)
    if join is not None:
        runs = join_ranks(rank, len(orders) - 1, kwargs, port=join, timeout=PIPE_TIMEOUT)
        if "stopped" in runs[0] and runs[0]["timed out"]:
            return {"timeout": PIPE_TIMEOUT}
        if "stopped" in runs[0]:  # the rank's own error, for the student's eyes here: never the judge's message
            print(runs[0]["stopped"], file=sys.stderr)
            return {"stopped": True}
        return {"ranks": runs}
    try:
        runs = run_forked(rank, len(orders), kwargs, timeout=PIPE_TIMEOUT)
    except TimeoutError:
        return {"timeout": PIPE_TIMEOUT}
    return {"ranks": [unpacked(run) for run in runs]}


def one_process(p: int, m: int, seed: int = 0, data_seed: int = 1, secret: int | None = None) -> tuple:
    """The same stages run one after the other in one process: each micro-batch's loss, every stage's (weight,
    bias) gradients of the mean loss, and each micro-batch's gradient of stage 0's output (what rank 1 sends back)."""
    stages, losses, first = pipeline_stages(p, seed=seed, secret=secret), [], []
    for x, y in micro_batches(m, data_seed):
        h = stages[0](x)
        h.retain_grad()
        out = h
        for stage in stages[1:]:
            out = stage(out)
        loss = mse(out, y)
        (loss / m).backward()
        losses.append(loss.item())
        first.append(h.grad)
    return losses, [(s.linear.weight.grad, s.linear.bias.grad) for s in stages], first


def ran_to_the_end(got: dict, label: str, events: list | None = None) -> list:
    """The student's ranks' results; where they stopped, why, read from the grader's rank 0's record (``events``)."""
    if "timeout" in got:
        raise AssertionError(f"{label}: the ranks were still running after {got['timeout']} s, a deadlock: "
                             + deadlock(events or []))
    assert "stopped" not in got, f"{label}: your ranks stopped with an error (printed above the test's result)"
    return got["ranks"]


def deadlock(events: list) -> str:
    """Why the ranks waited for each other, from what the grader's rank 0 was waiting for when its record ends."""
    blocking = ("a blocking send (dist.send, or isend(...).wait() at once) waits until the peer posts its receive, "
                "and once 1F1B's warm-up ends rank r sends an activation up while rank r + 1 sends a gradient down, "
                "each before its receive. Send with isend and wait on the work only once the peer must have "
                "received it (or at the end of the step)")
    last = next((e for e in reversed(events) if e["what"] in ("sending", "receiving")), None)
    if last is None or any(e["what"] == "stage 0" for e in events):
        return blocking + ", and run the actions in the order given"
    i = last["index"]
    if last["what"] == "sending":
        return (f"the grader's rank 0 was sending micro-batch {i}'s activation (a blocking send: it returns once "
                f"your rank 1 receives it, at its ('F', {i})), and your rank 1 never got there. " + blocking)
    return (f"the grader's rank 0, following its order, was waiting for micro-batch {i}'s gradient, which your rank 1 "
            f"sends at its ('B', {i}), and your rank 1 never got there: run the actions in the order given, each "
            "backward sending its gradient when it comes")


def judge_gradients(got: dict, p: int, m: int, label: str, seed: int = 0, data_seed: int = 1,
                    secret: int | None = None, first: int = 0) -> None:
    """The last rank's losses and ranks ``first`` to p - 1's stage gradients against one process's (stage 0 that
    of ``secret`` where rank 0 is the grader's)."""
    ranks = ran_to_the_end(got, label)
    losses, grads, _ = one_process(p, m, seed, data_seed, secret)
    assert len(ranks) == p - first, f"{label}: {len(ranks)} ranks answered, expected {p - first}"
    got_losses = ranks[-1]["losses"]
    assert isinstance(got_losses, list) and len(got_losses) == m and all(isinstance(x, float) for x in got_losses), (
        f"{label}: the last rank returned losses {got_losses!r}: return (losses, peak), the m losses as floats")
    gap = worst(abs(a - b) for a, b in zip(got_losses, losses))
    assert gap < 1e-5, f"{label}: the last rank's losses {got_losses} differ from one process's {losses}"
    for r, (run, want) in enumerate(zip(ranks, grads[first:]), start=first):
        assert len(run["grads"]) == 2, \
            f"{label}, rank {r}: {len(run['grads'])} gradients for its stage's weight and bias"
        for name, g, w in zip(("weight", "bias"), run["grads"], want):
            assert isinstance(g, torch.Tensor), f"{label}, rank {r}: its stage's {name} got no gradient ({g})"
            ratio = float(g.flatten() @ w.flatten() / (w.flatten() @ w.flatten()))
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-6), (
                f"{label}, rank {r}: its stage's {name} gradient differs from one process's (its projection on it is "
                f"{ratio:.2f} times it): the step's gradient is that of the mean over the {m} micro-batches, so "
                "scale each micro-batch's loss by 1/m before its backward")


def judge_activations(got: dict, orders: list, label: str, first: int = 0) -> None:
    """Ranks ``first`` to p - 1: the peak each counted is its order's, and what it held, measured, at most one
    more."""
    ranks = ran_to_the_end(got, label)
    assert len(ranks) == len(orders) - first, f"{label}: {len(ranks)} ranks answered, expected {len(orders) - first}"
    for r, (run, order) in enumerate(zip(ranks, orders[first:]), start=first):
        alive = peak = 0
        for kind, _ in order:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert run["peak"] == peak, (f"{label}, rank {r}: you counted {run['peak']} micro-batches held at most; "
                                     f"its order holds {peak} (forwards run minus backwards run, at its largest): "
                                     "run the actions in the order given, each backward when it comes")
        # one micro-batch more: its tensors may live on in local variables until the next forward rebinds them
        assert run["in flight"] <= peak + 1, (
            f"{label}, rank {r}: the activations of {run['in flight']} micro-batches were alive at once, measured "
            f"(the tensors autograd saved, until freed); the order needs {peak}. Drop every reference to micro-batch "
            "i's input and output once its backward ran: backward frees the graph, but not tensors you still hold")


# ---------------------------------------------------------------- the executor, as the grader's rank 0 sees it
# Rank 0 of a wired group is the grader's: its stage's weights are drawn at grading (``pipeline_stages``' secret),
# so the student's ranks compute the right losses only from the activations it sends. It follows its own order with
# blocking sends (each returns once rank 1 has received), the naive first stage: a student's rank that also blocks
# on a send, or that leaves the order, deadlocks against it as against itself. It records each gradient rank 1 sends
# back, and its own stage's gradients.
def executor_secret(name: str) -> int:
    """The seed of rank 0's stage in check ``name``: new to every grading (``case_seed``)."""
    return case_seed("nb13", name, "rank 0's stage")


def play_first_stage(wire: Wire, order: list, seed: int, data_seed: int, secret: int) -> None:
    """Rank 0's side of ``pipeline_rank`` (the grader's): stage 0 of ``pipeline_stages(..., secret=secret)`` on the
    micro-batches of ``data_seed``, following ``order``; what it is about to wait for, then each gradient received."""
    torch.set_num_threads(1)
    stage = pipeline_stages(dist.get_world_size(), seed=seed, secret=secret)[0]
    data, outputs = micro_batches(len(order) // 2, data_seed), {}
    for kind, i in order:
        if kind == "F":
            outputs[i] = stage(data[i][0])
            wire.record("sending", index=i)
            dist.send(outputs[i].detach(), 1)
        else:
            wire.record("receiving", index=i)
            grad = torch.empty(ROWS, WIDTH)
            dist.recv(grad, 1)
            wire.record("gradient", index=i, values=grad.clone())
            torch.autograd.backward(outputs.pop(i), grad)
    wire.record("stage 0", grads=[stage.linear.weight.grad.clone(), stage.linear.bias.grad.clone()])


def check_first_stage_wire(events: list, label: str, p: int, order: list, seed: int, data_seed: int, secret: int,
                           values: bool = True) -> None:
    """Every gradient the order's backwards wait for reached the grader's rank 0, each one process's gradient of
    stage 0's output (``values=False``: each of the activation's shape, whatever it holds)."""
    m = len(order) // 2
    _, grads, first = one_process(p, m, seed, data_seed, secret)
    got = {e["index"]: e["values"] for e in events if e["what"] == "gradient"}
    for kind, i in order:
        if kind != "B":
            continue
        assert i in got, (f"{label}: the grader's rank 0 never received micro-batch {i}'s gradient: rank 1 sends "
                          f"the gradient of its stage's input back to rank 0 at its ('B', {i}), of the activation's "
                          "shape")
        assert got[i].shape == first[i].shape, f"{label}: micro-batch {i}'s gradient came as {tuple(got[i].shape)}"
        if values:
            gap = float((got[i] - first[i]).abs().max()) / (float(first[i].abs().max()) + 1e-12)
            assert gap < 1e-4, (f"{label}: micro-batch {i}'s gradient, as the grader's rank 0 received it, differs "
                                f"from one process's gradient of stage 0's output (max rel. diff {gap:.1e}): each "
                                "micro-batch's backward starts from its loss / m, and the gradients go back in the "
                                "order's backwards")
    if values:
        stage0 = next(e["grads"] for e in events if e["what"] == "stage 0")
        assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-6) for g, w in zip(stage0, grads[0])), \
            f"{label}: the grader's stage 0 got another gradient than one process's"


def play_run(wire: Wire, round: int) -> None:
    """Rank 0 of ``test_run_1f1b``: ``GIVEN_2_4``'s first order, the weights of seed 0, its stage the secret's."""
    play_first_stage(wire, GIVEN_2_4[0], 0, 1, executor_secret("test_run_1f1b"))


def judge_run(got: dict, wire: list) -> str:
    secret = executor_secret("test_run_1f1b")
    ran_to_the_end(got, "p=2, m=4", wire)
    check_first_stage_wire(wire, "p=2, m=4", 2, GIVEN_2_4[0], 0, 1, secret)
    judge_gradients(got, 2, 4, "p=2, m=4", secret=secret, first=1)
    return "2 ranks, 4 micro-batches, rank 0 the grader's: one process's gradients reached it, your losses and yours"


register("test_run_1f1b", lambda ns: pipeline_runs(ns, GIVEN_2_4, join=peer_port("test_run_1f1b")), judge_run,
         Peer(world=2, play=play_run))


def counts(got: dict) -> dict:
    """What ``judge_activations`` reads of ``pipeline_runs``' data: each rank's peak, counted and measured."""
    return got if "ranks" not in got else {"ranks": [{k: run[k] for k in ("peak", "in flight")}
                                                     for run in got["ranks"]]}


def play_held(wire: Wire, round: int) -> None:
    play_first_stage(wire, GIVEN_2_4[0], 0, 1, executor_secret("test_run_1f1b_activations"))


def judge_held(got: dict, wire: list) -> str:
    """The wire says the order was followed (every gradient came, whatever its values: those are test_run_1f1b's);
    only the rank can say what it held."""
    ran_to_the_end(got, "p=2, m=4", wire)
    check_first_stage_wire(wire, "p=2, m=4", 2, GIVEN_2_4[0], 0, 1, executor_secret("test_run_1f1b_activations"),
                           values=False)
    judge_activations(got, GIVEN_2_4, "p=2, m=4", first=1)
    return "2 ranks, 4 micro-batches: at most the order's micro-batches alive, counted and measured"


register("test_run_1f1b_activations",
         lambda ns: counts(pipeline_runs(ns, GIVEN_2_4, join=peer_port("test_run_1f1b_activations"))), judge_held,
         Peer(world=2, play=play_held))
