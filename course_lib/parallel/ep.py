"""Expert parallelism by hand: a mixture-of-experts layer whose experts live on different ranks.

A mixture-of-experts (MoE) layer replaces one MLP by E smaller ones, the experts, and a router that
sends each token to its top-k of them: E times the parameters for about k MLPs' compute per token.
Experts are independent, so they split across ranks without cutting any weight: rank r keeps E/N of
them. The tokens move instead. Each rank routes its own tokens, tells every other rank how many it
will send to each of its experts (an all-to-all of counts), sends them (the dispatch all-to-all),
runs its experts on what arrived, and sends the results back (the combine all-to-all), where each
token's outputs are summed with its gate weights.

- ``MoE``: router (linear -> softmax -> top-k), capacity per expert, dropped tokens, and the Switch
  load-balancing loss; ``MoE.forward(x, groups)`` routes each group of tokens on its own, as GShard does.
- ``expert_parallel_forward``: the same layer with its experts spread over ``group``'s ranks, equal to
  ``moe(all ranks' tokens, groups=their counts)`` in output and gradients.

What current MoEs do instead, measured beside it: **dropless** experts (``dropless_forward``: every choice
computed, each expert's rows one group of a grouped matmul, ``grouped_mm``); **auxiliary-loss-free balancing**
(DeepSeek-V3: a per-expert bias on the router's scores that picks experts but never weighs them,
``MoE.update_bias``; ``balancing_runs`` sets it beside the Switch loss); and the **gate convention**
(``normalize_gates``: the top-k probabilities as they are, or renormalised to sum to 1 over the k).

**Capacity.** Expert e takes at most ``ceil(capacity_factor x tokens x top_k / E)`` tokens of a group;
every token's first choice queues before any token's second choice (GShard's priority), in token order,
and a choice past the capacity is dropped: that expert adds nothing to the token (the residual stream
around the layer carries it). Under expert parallelism a group is one rank's tokens: each rank routes
alone, with no exchange, so capacity is per rank, and the one-process reference routes the same groups.

What its all-to-alls carry per rank is ``ep_cost``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _rank_world(group=None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class Expert(nn.Module):
    """One expert: a small SwiGLU MLP, as in Llama's and Mixtral's layers."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


@dataclass
class Routing:
    """Where one group's tokens go: one row per kept (token, expert) choice, and what was dropped."""

    token: torch.Tensor  # (kept,) index of the token in the group
    expert: torch.Tensor  # (kept,) the expert it goes to
    gate: torch.Tensor  # (kept,) float32 router probability: the weight of this expert's output
    dropped: int  # choices past their expert's capacity
    aux_loss: torch.Tensor  # the Switch load-balancing loss of the group
    load: torch.Tensor | None = None  # (E,) choices sent to each expert, before capacity


# graded: 17_expert_parallelism expert_parallel
def within_capacity(expert: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """Which choices fit: ``expert`` (choices,) in queue order -> True where fewer than ``cap`` of the same
    expert's choices queued before it (GShard's priority: the queue holds every first choice first)."""
    onehot = F.one_hot(expert, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many choices of this expert queued before this one
    return place < cap


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Tokens one expert takes from a group of ``tokens``: ceil(factor x tokens x k / E); all of them if None."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``n_experts`` SwiGLU experts, each token sent to its ``top_k`` best.

    ``capacity_factor=None`` drops nothing. After a forward, ``self.aux_loss`` is the load-balancing loss
    (add ``coefficient x aux_loss`` to the training loss) and ``self.dropped`` the choices dropped.
    ``normalize_gates``: weigh a token's k expert outputs by their router probabilities renormalised to sum to 1
    (Mixtral, DeepSeek-V3, Qwen's ``norm_topk_prob``), not by the probabilities as they are (Switch, GShard's
    code here). ``score_bias`` (zeros until ``update_bias``) is added to the scores that pick the experts only.
    Parameters are drawn from ``seed`` alone, so every rank that builds it holds the same layer.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                 hidden: int | None = None, seed: int = 0, normalize_gates: bool = False):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.normalize_gates = normalize_gates
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(d_model, n_experts, bias=False)
            self.experts = nn.ModuleList(Expert(d_model, hidden or 2 * d_model) for _ in range(n_experts))
        self.register_buffer("score_bias", torch.zeros(n_experts))
        self.aux_loss, self.dropped = torch.zeros(()), 0

    def route(self, x: torch.Tensor, keep=None) -> Routing:
        """Route one group of tokens ``x`` (tokens, d_model): top-k, then capacity, then the balance loss.

        ``keep``: the capacity rule, ``within_capacity``'s signature (the notebook passes the student's)."""
        probs = F.softmax(self.router(x).float(), dim=-1)  # float32: the gates weight every expert output
        expert = (probs + self.score_bias).topk(self.top_k, dim=-1).indices  # the bias picks, it never weighs
        gate = probs.gather(-1, expert)  # (tokens, k)
        if self.normalize_gates:
            gate = gate / gate.sum(-1, keepdim=True)
        # queue order: all first choices (in token order), then all second choices, ...
        expert, gate = expert.t().reshape(-1), gate.t().reshape(-1)
        token = torch.arange(len(x), device=x.device).repeat(self.top_k)
        chosen = F.one_hot(expert, self.n_experts)  # for the balance loss: which expert each choice went to
        keep = (keep or within_capacity)(expert, self.n_experts,
                                         capacity(len(x), self.n_experts, self.top_k, self.capacity_factor))
        # Switch: E x sum_e (share of choices sent to e) x (mean probability of e); 1 when perfectly balanced.
        # The share has no gradient; the mean probability carries it to the router.
        aux = self.n_experts * (chosen.float().mean(0) * probs.mean(0)).sum()
        load = torch.bincount(expert, minlength=self.n_experts)
        return Routing(token[keep], expert[keep], gate[keep], int((~keep).sum()), aux, load)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3), after a step that sent ``load`` (E,) choices to each expert:
        raise by ``rate`` the bias of every expert below the mean load, lower the others'. No gradient and no loss
        term: the router's weights, and so every gate value, stay what the task trains them to be."""
        load = load.float()
        self.score_bias += rate * torch.sign(load.mean() - load)

    def forward(self, x: torch.Tensor, groups: int | list[int] = 1, keep=None) -> torch.Tensor:
        """x (..., d_model); ``groups``: equal groups routed apart, or their token counts (see the module's text);
        ``keep``: the capacity rule (``route``)."""
        tokens = x.reshape(-1, x.shape[-1])
        sizes = _group_sizes(len(tokens), groups)
        out, routings = torch.zeros_like(tokens), []
        for start, size in zip(accumulate([0, *sizes]), sizes):
            r = self.route(tokens[start:start + size], keep)
            for e in range(self.n_experts):  # each expert runs once on every token of the group sent to it
                rows = start + r.token[r.expert == e]
                y = self.experts[e](tokens[rows])
                out = out.index_add(0, rows, (r.gate[r.expert == e, None] * y).to(out.dtype))
            routings.append(r)
        self.aux_loss = torch.stack([r.aux_loss for r in routings]).mean()
        self.dropped = sum(r.dropped for r in routings)
        return out.view_as(x)


def keep_every_choice(expert: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """The capacity rule of a layer with no capacity (``within_capacity``'s signature): every choice kept."""
    return torch.ones_like(expert, dtype=torch.bool)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` (rows, d) in groups of ``counts`` (G,), group g times its own matrix ``w[g]`` (G, d, h): one grouped
    matmul, however unequal the groups. torch's ``_grouped_mm`` kernel where a CUDA GPU runs it (bf16, rows 16-byte
    aligned), a loop of matmuls elsewhere; the same numbers either way."""
    fused = (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
             and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)
    if fused:
        return torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
    return torch.cat([part @ w[g] for g, part in enumerate(x.split(counts.tolist()))])


def dropless_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe`` on ``x`` (..., d_model) with no capacity: every choice computed, the choices sorted by expert and each
    expert's SwiGLU run as one group of three grouped matmuls over the experts' stacked weights. Equals ``moe`` with
    ``capacity_factor=None`` in output and gradients; sets ``moe.aux_loss``, ``moe.dropped`` (0) and ``moe.load``."""
    tokens = x.reshape(-1, x.shape[-1])
    r = moe.route(tokens, keep=keep_every_choice)
    order, counts = torch.argsort(r.expert, stable=True), r.load  # every choice kept: the load is each group's rows
    stacked = {name: torch.stack([getattr(e, name).weight.t() for e in moe.experts]) for name in ("gate", "up", "down")}
    rows = tokens[r.token[order]]
    hidden = F.silu(grouped_mm(rows, stacked["gate"], counts)) * grouped_mm(rows, stacked["up"], counts)
    y = grouped_mm(hidden, stacked["down"], counts)
    out = torch.zeros_like(tokens).index_add(0, r.token[order], (r.gate[order, None] * y).to(tokens.dtype))
    moe.aux_loss, moe.dropped, moe.load = r.aux_loss, 0, r.load
    return out.view_as(x)


def imbalance(load: torch.Tensor) -> float:
    """The busiest expert's choices over the mean: 1 when balanced, E when one expert takes every choice."""
    return float(load.max() / load.float().mean())


def balancing_runs(d_model: int, n_experts: int, top_k: int, tokens: int, steps: int, seed: int = 0,
                   lr: float = 0.05, rate: float = 0.005) -> dict:
    """The load ``imbalance`` of one router, step by step, under three ways of balancing it, on the same skewed
    tokens (a shared offset the untrained router prefers some experts for; fresh tokens every step): none, the
    Switch loss (SGD at ``lr`` on the router alone, no task loss), and the score bias (``update_bias`` at ``rate``).
    Per way: ``imbalance`` per step and ``router_change``, the largest change of a router weight."""
    g = torch.Generator().manual_seed(seed + 1)
    offset = torch.randn(d_model, generator=g)
    batches = [torch.randn(tokens, d_model, generator=g) + offset for _ in range(steps)]
    runs = {}
    for way in ("none", "Switch loss", "score bias"):
        moe = MoE(d_model, n_experts, top_k, capacity_factor=None, seed=seed)
        start = moe.router.weight.detach().clone()
        sgd = torch.optim.SGD(moe.router.parameters(), lr=lr)
        history = []
        for x in batches:
            with torch.set_grad_enabled(way == "Switch loss"):
                r = moe.route(x, keep=keep_every_choice)
            history.append(imbalance(r.load))
            if way == "Switch loss":
                sgd.zero_grad()
                r.aux_loss.backward()
                sgd.step()
            elif way == "score bias":
                moe.update_bias(r.load, rate)
        runs[way] = {"imbalance": history, "router_change": float((moe.router.weight.detach() - start).abs().max())}
    return runs


def _group_sizes(tokens: int, groups: int | list[int]) -> list[int]:
    if isinstance(groups, int):
        if tokens % groups:
            raise ValueError(f"{tokens} tokens do not split into {groups} equal groups: give the groups' sizes")
        return [tokens // groups] * groups
    if sum(groups) != tokens:
        raise ValueError(f"group sizes {groups} sum to {sum(groups)}, not the {tokens} tokens given")
    return list(groups)


# ---------------------------------------------------------------------------------------------------------
# Expert parallelism: dispatch, local experts, combine


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with a backward: each row's gradient goes back to where the row came from.

    ``dist.all_to_all_single`` alone has no backward; the one it needs is the same all-to-all with the
    send and receive splits swapped.
    """

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange_rows(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange_rows(grad, recv_splits, send_splits, ctx.group), None, None, None


def _exchange_rows(x, send_splits, recv_splits, group):
    out = x.new_empty(sum(recv_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    """Rows ``x[...]`` in ``send_splits`` blocks, block i to rank i; returns the ``recv_splits`` blocks received."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


@dataclass
class Plan:
    """What a dispatch did, which the combine undoes."""

    order: torch.Tensor  # the kept choices, sorted by expert: the order their rows were sent in
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    recv_counts: torch.Tensor  # (world, local experts): rows each rank sent to each of this rank's experts


# graded: 17_expert_parallelism expert_parallel
def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts (E,): the rows this rank sends to each expert -> (world, E/world): the rows every rank sends here.

    Experts sit in blocks of E/N, rank r owning experts r*E/N ... : an all-to-all of equal blocks of the
    counts tells each rank, before any token moves, how many rows to expect from whom, for which expert.
    """
    _, world = _rank_world(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(world, -1)


# graded: 17_expert_parallelism expert_parallel
def dispatch(tokens: torch.Tensor, routing: Routing, n_experts: int, group=None) -> tuple[torch.Tensor, Plan]:
    """Send every kept (token, expert) choice's row to the rank that owns the expert: (rows received, plan)."""
    _, world = _rank_world(group)
    order = torch.argsort(routing.expert, stable=True)  # by expert, hence by the rank that owns it
    counts = torch.bincount(routing.expert, minlength=n_experts)
    recv_counts = exchange_counts(counts, group)  # the split sizes first: receive buffers need their sizes
    send_splits = counts.view(world, -1).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = all_to_all(tokens[routing.token[order]], send_splits, recv_splits, group)
    return received, Plan(order, send_splits, recv_splits, recv_counts)


def run_local_experts(moe: MoE, received: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    """Each of this rank's experts on the rows sent to it; the outputs in the rows' received order."""
    world, local = plan.recv_counts.shape
    # the rows arrive by source rank, and within one source by expert (the sender sorted them)
    experts = torch.arange(local, device=received.device).repeat(world)
    expert_of_row = experts.repeat_interleave(plan.recv_counts.flatten())
    out = received.new_zeros(received.shape)
    for j in range(local):
        rows = (expert_of_row == j).nonzero().squeeze(1)
        out = out.index_copy(0, rows, moe.experts[rank * local + j](received[rows]))
    return out


# graded: 17_expert_parallelism expert_parallel
def combine(expert_out: torch.Tensor, routing: Routing, plan: Plan, n_tokens: int, group=None) -> torch.Tensor:
    """Send the outputs back (the dispatch's all-to-all reversed) and sum each token's with its gate weights."""
    back = all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)  # rows return in the order sent
    token, gate = routing.token[plan.order], routing.gate[plan.order]  # ... which is the order sorted by expert
    out = back.new_zeros(n_tokens, back.shape[-1])
    return out.index_add(0, token, (gate[:, None] * back).to(back.dtype))


def expert_parallel_forward(moe: MoE, x: torch.Tensor, group=None, *, dispatch_fn=None, combine_fn=None,
                            keep_fn=None) -> torch.Tensor:
    """``moe`` on this rank's tokens ``x`` (..., d_model), its experts spread over ``group``'s ranks.

    Rank r runs experts r*E/N ... (r+1)*E/N - 1 (every rank holds the whole layer here, which is small; only
    its own experts and the router get gradients on it). Equals ``moe(cat of every rank's tokens, groups=
    their counts)``: output, and gradients once the router's are summed over ranks. ``dispatch_fn``,
    ``combine_fn``, ``keep_fn``: ``dispatch``, ``combine`` and ``within_capacity`` to use (the notebook passes
    the student's). Sets ``moe.aux_loss``
    and ``moe.dropped`` for this rank's group, and ``moe.traffic``: the rows this rank dispatched and
    received, and the splits.
    """
    rank, world = _rank_world(group)
    if moe.n_experts % world:
        raise ValueError(f"{moe.n_experts} experts do not split over {world} ranks: "
                         f"use a number of experts that is a multiple of the world size")
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.route(tokens, keep_fn)  # no exchange: each rank routes (and applies capacity to) its own tokens
    received, plan = (dispatch_fn or dispatch)(tokens, routing, moe.n_experts, group)
    out = (combine_fn or combine)(run_local_experts(moe, received, plan, rank), routing, plan, len(tokens), group)
    moe.aux_loss, moe.dropped = routing.aux_loss, routing.dropped
    moe.traffic = {"dispatched": sum(plan.send_splits), "received": sum(plan.recv_splits),
                   "send_splits": plan.send_splits, "recv_splits": plan.recv_splits}
    return out.view_as(x)
