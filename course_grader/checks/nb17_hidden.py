"""Notebook 17's hidden tests (instructor edition only): expert parallelism on 3 and 4 ranks with unequal token
counts, with and without dropping (rank 0 the grader's)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import course_lib.parallel.ep as ep
from course_grader.checks import case_seed, peer_port, register
from course_grader.checks.nb17 import AUX, EP_D, TOP_K, ep_data, ep_runs, judge_ep, secret_experts, sizes_of
from course_grader.peer import Peer, Wire, rounds
from course_lib.distributed import CollectiveBytes

EP_CASES = ((3, 6, None), (4, 8, 1.0))  # capacity 1.0 drops choices whatever the seed (4 at the least of 200 tried)


def ep_seeds(i: int) -> dict:
    """A layer's weights' and tokens' seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb15", "experts", i, "weights"), "data_seed": case_seed("nb15", "experts", i, "data")}


# ---------------------------------------------------------------- expert_parallel, as the grader's rank 0 sees it
# Rank 0 of every hidden layer is the grader's: its experts are drawn at grading (``secret_experts``), so the
# student's ranks compute the right outputs and router gradients only from the rows its experts send back. It runs
# the contract's dispatch and combine (the answer: this side lives in the hidden module; the visible test reads the
# ranks) and records the counts and rows its experts receive, the gradients that come back for their outputs,
# and its own results, which the judge puts beside the student's ranks'.
def ep_secret(i: int) -> int:
    return case_seed("nb15", "experts", i, "rank 0's experts")


# Where the grader's rank runs, course_lib's capacity rule, dispatch and combine are the release's stubs (the
# student's answers are absent there, as everywhere the student's code runs), so this side carries its own.
def keep_first(expert: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """GShard's capacity rule: each expert keeps the first ``cap`` choices of its queue."""
    seen = F.one_hot(expert, n_experts).cumsum(0).gather(1, expert[:, None]).squeeze(1)  # its place, from 1
    return seen <= cap


def send_rows(tokens: torch.Tensor, routing, n_experts: int, group=None) -> tuple[torch.Tensor, ep.Plan]:
    """Each kept choice's row to its expert's rank, the counts first: (rows received, plan)."""
    world = dist.get_world_size(group)
    order = torch.argsort(routing.expert, stable=True)
    counts = torch.bincount(routing.expert, minlength=n_experts)
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=group)
    plan = ep.Plan(order, counts.view(world, -1).sum(1).tolist(), theirs.view(world, -1).sum(1).tolist(),
                   theirs.view(world, -1))
    return ep.all_to_all(tokens[routing.token[order]], plan.send_splits, plan.recv_splits, group), plan


def rows_back(expert_out: torch.Tensor, routing, plan: ep.Plan, n_tokens: int, group=None) -> torch.Tensor:
    """The experts' outputs back to their tokens' ranks, each added into its token times its gate."""
    back = ep.all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)
    weighted = (routing.gate[plan.order, None] * back).to(back.dtype)
    return back.new_zeros(n_tokens, back.shape[-1]).index_add(0, routing.token[plan.order], weighted)


def play_experts(wire: Wire, round: int) -> None:
    world, n_experts, factor = EP_CASES[round]
    seeds = ep_seeds(round)
    torch.set_num_threads(1)
    moe = secret_experts(ep.MoE(EP_D, n_experts, TOP_K, factor, seed=seeds["seed"]), world, ep_secret(round))
    x, w = (t[:sizes_of(world)[0]] for t in ep_data(world, seeds["data_seed"]))
    x.requires_grad_()

    def dispatch(tokens, routing, n, group=None):
        received, plan = send_rows(tokens, routing, n, group)
        wire.record("received", counts=plan.recv_counts.clone(), rows=received.detach().clone())
        return received, plan

    def combine(expert_out, routing, plan, n_tokens, group=None):  # the outputs' gradients arrive in its backward
        expert_out.register_hook(lambda g: wire.record("gradients", rows=g.clone()))
        return rows_back(expert_out, routing, plan, n_tokens, group)

    with CollectiveBytes() as comm:
        out = ep.expert_parallel_forward(moe, x, dispatch_fn=dispatch, combine_fn=combine, keep_fn=keep_first)
        ((out * w).sum() + AUX * moe.aux_loss / world).backward()
    wire.record("rank 0", out=out.detach().clone(), dx=x.grad.clone(), dropped=moe.dropped,
                grads={n: q.grad.clone() for n, q in moe.named_parameters() if q.grad is not None},
                bytes={str(k): int(v) for k, v in comm.bytes_by_kind.items()})


def blocks_at_rank_0(world: int, n_experts: int, factor, seed: int, data_seed: int, secret: int) -> dict:
    """What rank 0's experts receive from each rank in one process's routing, by (rank, expert): the rows' count,
    their sum, and the sum of the gradients of those rows' outputs (each its gate times the loss's weight)."""
    moe = secret_experts(ep.MoE(EP_D, n_experts, TOP_K, factor, seed=seed), world, secret)
    x, w = ep_data(world, data_seed)
    out, start = {}, 0
    for r, size in enumerate(sizes_of(world)):
        with torch.no_grad():
            routing = moe.route(x[start:start + size], keep_first)
        for e in range(n_experts // world):
            mine = routing.expert == e
            rows = routing.token[mine] + start
            out[r, e] = (int(mine.sum()), x[rows].sum(0), (routing.gate[mine, None] * w[rows]).sum(0))
        start += size
    return out


def check_ep_wire(events: list, label: str, world: int, n_experts: int, factor, seed: int, data_seed: int,
                  secret: int) -> dict:
    """What reached the grader's rank 0: each rank's counts for its experts, the rows (compared by (rank, expert)
    block, in any order within one), then their outputs' gradients. Returns rank 0's own results."""
    local = n_experts // world
    want = blocks_at_rank_0(world, n_experts, factor, seed, data_seed, secret)
    got = {e["what"]: e for e in events}
    assert "received" in got, (f"{label}: the grader's rank 0 never received its experts' rows: exchange the counts "
                               f"(one all-to-all of E = {n_experts} int64 counts), then the rows, sorted by expert")
    counts = got["received"]["counts"]
    expected = torch.tensor([[want[r, e][0] for e in range(local)] for r in range(world)])
    assert counts.shape == expected.shape and torch.equal(counts, expected), (
        f"{label}: the counts of rows for rank 0's experts, as the grader's rank 0 received them, were "
        f"{counts.tolist()}; each rank sends how many of its kept choices go to each expert: {expected.tolist()}")
    for what, k, hint in (("received", 1, "each rank sends its kept choices' token rows, sorted by expert"),
                          ("gradients", 2, "combine's all-to-all carries the outputs back, and autograd their "
                                           "gradients (each row's gate times the loss's gradient) to rank 0")):
        assert what in got, f"{label}: the grader's rank 0 never received its experts' outputs' gradients: {hint}"
        rows, at = got[what]["rows"], 0
        for r in range(world):
            for e in range(local):
                n, block = want[r, e][0], rows[at:at + want[r, e][0]].sum(0)
                at += n
                gap = float((block - want[r, e][k]).abs().max()) / (float(want[r, e][k].abs().max()) + 1e-12)
                assert gap < 1e-4, (f"{label}: the {'rows' if k == 1 else 'gradients'} rank {r} sent to rank 0's "
                                    f"expert {e} differ from one process's routing (max rel. diff {gap:.1e}): {hint}")
    assert "rank 0" in got, f"{label}: the grader's rank 0 stopped before the layer's backward ended"
    return {k: v for k, v in got["rank 0"].items() if k not in ("what", "t")}


def probe_ep(ns: dict) -> list:
    got = []
    for i, case in enumerate(EP_CASES):
        got.append(runs := ep_runs(ns, *case, **ep_seeds(i), join=peer_port("test_expert_parallel_hidden", i)))
        if any("stopped" in run for run in runs):  # the judge reports the first layer that stopped
            break
    return got


def judge_ep_hidden(got: list, wire: list) -> str:
    for i, (case, events) in enumerate(zip(EP_CASES, rounds(wire, len(EP_CASES)))):
        assert i < len(got), f"{len(got)} layers ran of the {len(EP_CASES)} cases"
        runs = got[i]
        label = f"{case[0]} ranks, {case[1]} experts, capacity factor {case[2]}"
        assert not any("stopped" in run for run in runs) or "received" in {e["what"] for e in events}, (
            f"{label}: your ranks stopped before the grader's rank 0 received its experts' rows: the counts first "
            "(one all-to-all of E int64), then the rows")
        mine = check_ep_wire(events, label, *case, **ep_seeds(i), secret=ep_secret(i))
        judge_ep([mine, *runs], *case, **ep_seeds(i), secret=ep_secret(i))
    return ("3 ranks x 2 experts and 4 ranks x 2 experts, rank 0 the grader's: unequal tokens, with and without "
            "dropping")


register("test_expert_parallel_hidden", probe_ep, judge_ep_hidden,
         Peer(world=tuple(case[0] for case in EP_CASES), play=play_experts, rounds=len(EP_CASES)))
