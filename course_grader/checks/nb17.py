"""Notebook 17's visible test: the student's expert-parallel dispatch and combine on 2 forked ranks against the
one-process mixture of experts (output, gradients, drops, bytes)."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

import course_lib.parallel.ep as ep
import course_lib.parallel.ep_cost as ep_cost

from course_grader.checks import error_text, in_ranks, number, packed, plain, register, student, tensor_data
from course_grader.grading import forbid
from course_grader.peer import join_ranks
from course_lib.distributed import CollectiveBytes

# What the exercise builds, out of reach while the student's code runs. (ep.all_to_all, ep.Plan and ep.Routing are
# the helpers it may use.)
EP_ANSWERS = (ep.exchange_counts, ep.dispatch, ep.combine, ep.within_capacity)
EXPERTS = ("within_capacity", "dispatch", "combine")


# ---------------------------------------------------------------- expert_parallel
EP_D, TOP_K, AUX = 8, 2, 0.1


def sizes_of(world: int) -> list[int]:
    return [5 + 2 * r for r in range(world)]  # every rank a different number of tokens: the split sizes differ


def ep_data(world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes_of(world))
    return torch.randn(n, EP_D, generator=g), torch.randn(n, EP_D, generator=g)  # tokens, the loss's weights


def secret_experts(moe: ep.MoE, world: int, secret: int) -> ep.MoE:
    """``moe`` with rank 0's experts (the first E / ``world``) drawn from ``secret``, at their initial scale: the
    experts of the grader's rank 0, whose outputs reach the student's ranks only over the wire."""
    g = torch.Generator().manual_seed(secret)
    with torch.no_grad():
        for expert in moe.experts[:moe.n_experts // world]:
            for q in expert.parameters():
                q.copy_((torch.rand(q.shape, generator=g) * 2 - 1) / q.shape[1] ** 0.5)
    return moe


def ep_rank(n_experts: int, factor, ns: dict, seed: int = 0, data_seed: int = 1) -> bytes:
    """One rank: the layer's experts (the weights of ``seed``) spread over the ranks with the student's capacity rule,
    dispatch and combine, on its tokens of ``ep_data(world, data_seed)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    moe = ep.MoE(EP_D, n_experts, TOP_K, factor, seed=seed)
    x, w = ep_data(world, data_seed)
    start = sum(sizes_of(world)[:rank])
    x, w = (t[start:start + sizes_of(world)[rank]] for t in (x, w))
    x.requires_grad_()
    try:
        with forbid(*EP_ANSWERS, namespace=ns):
            with CollectiveBytes() as comm:
                out = ep.expert_parallel_forward(moe, x, dispatch_fn=ns["dispatch"], combine_fn=ns["combine"],
                                                 keep_fn=ns["within_capacity"])
                ((out * w).sum() + AUX * moe.aux_loss / world).backward()
        grads = {n: tensor_data(p.grad) for n, p in moe.named_parameters() if p.grad is not None}
        got = {"out": tensor_data(out, torch.float32), "dx": tensor_data(x.grad), "grads": grads,
               "dropped": number(moe.dropped), "bytes": {str(k): number(v) for k, v in comm.bytes_by_kind.items()}}
    except Exception as err:
        got = {"raised": error_text(err)[:300]}
    return packed(plain(got))


def ep_runs(ns: dict, world: int, n_experts: int, factor, seed: int = 0, data_seed: int = 1,
            join: int | None = None) -> list:
    """``ep_rank`` on ``world`` forked ranks; with ``join`` (the port of the grader's rank 0) on ranks 1 to
    ``world - 1`` of a group whose rank 0 is the grader's."""
    kwargs = dict(n_experts=n_experts, factor=factor, seed=seed, data_seed=data_seed)
    if join is None:
        return in_ranks(ns, EXPERTS, ep_rank, world, timeout=30, **kwargs)
    return join_ranks(functools.partial(ep_rank, ns=student(ns, *EXPERTS)), world - 1, kwargs, port=join, timeout=30)


# The capacity rule's answers on the visible test's groups of tokens, (queue of experts, cap) -> which choices are
# kept: the student edition cannot compute them (ep.within_capacity is the exercise), so they are written out, as
# a worked example is. tests/test_ep.py holds them to ep.within_capacity.
VISIBLE_KEPT = {
    ((1, 2, 3, 0, 2, 3, 0, 2, 2, 3), 3): "1111111101",
    ((2, 2, 2, 0, 1, 1, 0, 0, 0, 1, 2, 0, 0, 1), 4): "11111111111001",
}


def visible_keep(expert: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """The capacity rule on the visible test's groups (VISIBLE_KEPT); nothing dropped where ``cap`` holds them all."""
    if cap >= len(expert):
        return torch.ones_like(expert, dtype=torch.bool)
    return torch.tensor([c == "1" for c in VISIBLE_KEPT[(tuple(expert.tolist()), cap)]])


def ep_reference(world: int, n_experts: int, factor, keep=None, seed: int = 0, data_seed: int = 1,
                 secret: int | None = None) -> dict:
    """One process, the same groups of tokens: output, input and parameter gradients, drops, and each rank's bytes.
    ``keep``: the capacity rule (default ``ep.within_capacity``, the grader's); ``secret``: rank 0's experts drawn
    from it (``secret_experts``)."""
    moe = ep.MoE(EP_D, n_experts, TOP_K, factor, seed=seed)
    if secret is not None:
        secret_experts(moe, world, secret)
    x, w = ep_data(world, data_seed)
    x.requires_grad_()
    out = moe(x, groups=sizes_of(world), keep=keep)
    ((out * w).sum() + AUX * moe.aux_loss).backward()
    local, kept, received = n_experts // world, [], [0] * world
    for start, size in zip([sum(sizes_of(world)[:r]) for r in range(world)], sizes_of(world)):
        routing = moe.route(x.detach()[start:start + size], keep)
        kept.append(len(routing.expert))
        for r in range(world):
            received[r] += int(((routing.expert // local) == r).sum())
    step = [ep_cost.ep_bytes_per_rank(kept[r], received[r], EP_D, 4, n_experts)["step"] for r in range(world)]
    return {"out": out.detach(), "dx": x.grad, "dropped": moe.dropped, "step bytes": step,
            "grads": {n: p.grad for n, p in moe.named_parameters()}}


def judge_ep(runs: list, world: int, n_experts: int, factor, keep=None, seed: int = 0, data_seed: int = 1,
             secret: int | None = None) -> None:
    """Every rank's results (rank 0's the grader's where ``secret`` drew its experts) against ``ep_reference``."""
    label = f"{world} ranks, {n_experts} experts, capacity factor {factor}"
    assert not any("stopped" in run for run in runs), f"{label}: your ranks stopped after rank 0's all-to-alls"
    assert len(runs) == world, f"{label}: {len(runs)} ranks answered"
    for r, run in enumerate(runs):
        assert "raised" not in run, f"{label}, rank {r}: your code raised {run.get('raised')}"
    want = ep_reference(world, n_experts, factor, keep, seed, data_seed, secret)
    for name in ("out", "dx"):
        parts = [run[name] for run in runs]
        assert all(isinstance(p, torch.Tensor) for p in parts), f"{label}: {name} is not a tensor on every rank"
        got = torch.cat(parts)
        assert got.shape == want[name].shape and torch.allclose(got, want[name], atol=1e-5, rtol=1e-4), (
            f"{label}: {'the output' if name == 'out' else 'the input gradient'} differs from the one-process layer's"
            f"{'' if got.shape != want[name].shape else f' by {float((got - want[name]).abs().max()):.1e}'}: are the "
            "returned rows summed into the tokens they came from (the order you sent them in), with their gate "
            "weights?")
    dropped = sum(run["dropped"] for run in runs if isinstance(run["dropped"], int))
    assert dropped == want["dropped"], (f"{label}: {dropped} choices dropped, the one-process layer drops "
                                        f"{want['dropped']}: each expert keeps the first `cap` choices of its queue")
    router = sum(run["grads"].get("router.weight", 0) for run in runs)
    assert isinstance(router, torch.Tensor) and torch.allclose(router, want["grads"]["router.weight"], atol=1e-5), \
        f"{label}: the router's gradient (summed over ranks) differs: do the gate weights multiply the returned rows?"
    local = n_experts // world
    for name, g in want["grads"].items():
        if name.startswith("experts."):
            mine = runs[int(name.split(".")[1]) // local]["grads"].get(name)
            assert isinstance(mine, torch.Tensor) and torch.allclose(mine, g, atol=1e-5, rtol=1e-4), \
                f"{label}: {name}'s gradient on its owner differs from the one-process layer's"
    for r, run in enumerate(runs):
        assert run["bytes"] == {"all_to_all": want["step bytes"][r]}, (
            f"{label}, rank {r}: your step moved {run['bytes']} (bytes by kind); expected "
            f"{{'all_to_all': {want['step bytes'][r]}}}: the counts, the tokens, the results back, and backward")


def probe_ep(ns: dict) -> dict:
    return {factor: ep_runs(ns, 2, 4, factor) for factor in (None, 1.0)}


def judge_ep_visible(got: dict) -> str:
    for factor in (None, 1.0):
        judge_ep(got[factor], 2, 4, factor, keep=visible_keep)
    return "2 ranks, 4 experts, with and without dropping: the one-process layer's output, gradients, drops; bytes"


register("test_expert_parallel", probe_ep, judge_ep_visible)
