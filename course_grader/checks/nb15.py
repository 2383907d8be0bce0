"""Notebook 15's visible tests: the 1F1B order (simulated, and against the order torch's Schedule1F1B ran on 2 ranks,
which no message prints), and the executor on 2 forked ranks following a given order that is not 1F1B's (one
process's losses and gradients; the micro-batches it holds, counted and measured), with the grader's own rank as
rank 0 (stage 0)."""

from __future__ import annotations

import functools
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import course_lib.parallel.pp as pp
import course_lib.parallel.pp_cost as pp_cost
import course_lib.parallel.pp_torch as pp_torch

from course_grader.checks import (case_seed, number, packed, peer_port, plain, register, student,
                                  tensor_data, unpacked)
from course_grader.grading import forbid, worst
from course_grader.peer import Peer, Wire, join_ranks
from course_lib.launch import run_forked

# What each exercise builds, out of reach while the student's code runs.
PP_ANSWERS = (pp.one_f_one_b_order, pp.gpipe_order, pp.torch_order, Schedule1F1B, ScheduleGPipe)


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
        sim = pp_cost.schedule_makespan(order, t_f=1.0, t_b=2.0)
    except ValueError as err:
        raise AssertionError(f"p={p}, m={m}: the order cannot run: {err}") from None
    formula = pp_cost.bubble_formula(p, m)
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
    res = pp_torch.train(pp_torch.PPRun(schedule="1f1b", microbatches=m, steps=1, layers=layers, batch=batch, seq=8,
                                        seed=0))
    return pp.rank_orders(res["timeline"])


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
PIPE_ANSWERS = PP_ANSWERS + (pp.run_1f1b, pp_torch.naive_step, pp_torch.train, PipelineStage)
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
    return case_seed("nb14", name, "rank 0's stage")


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
