"""course_lib.parallel.ep and ep_cost: a mixture-of-experts layer, and its experts spread over real gloo ranks.

One fork per world size (2, 3, 4 ranks, each with a different number of tokens) checks that the
expert-parallel layer equals the one-process layer on the same groups of tokens (output, input and
router and expert gradients), with and without dropping; that the split sizes each rank sends are
those the others receive; that ``CollectiveBytes`` sees the bytes ``ep_bytes_per_rank`` gives; and that
two known mistakes (the combine summing rows in the wrong order, capacity ignored) fail the comparison.
"""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import CollectiveBytes
from course_lib.launch import WorkerError, run_forked
from course_lib.parallel import ep, ep_cost

D, TOP_K, AUX = 8, 2, 0.1
EXPERTS = {2: 4, 3: 6, 4: 4}
FACTORS = (None, 1.0)  # nothing dropped; some choices dropped


def _sizes(world):
    return [5 + r for r in range(world)]  # every rank a different number of tokens


def _data(world):
    g = torch.Generator().manual_seed(1)
    n = sum(_sizes(world))
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)  # tokens, and the loss's weights


def _reference(world, factor):
    """One process, the same groups of tokens: output, dropped, and every gradient of the same loss."""
    moe = ep.MoE(D, EXPERTS[world], TOP_K, factor)
    x, w = _data(world)
    x.requires_grad_()
    out = moe(x, groups=_sizes(world))
    ((out * w).sum() + AUX * moe.aux_loss).backward()
    return out.detach(), x.grad, moe.dropped, {n: p.grad for n, p in moe.named_parameters()}


def _wrong_combine(expert_out, routing, plan, n_tokens, group=None):
    """The known mistake: the returned rows summed in token order, not in the (sorted) order they were sent."""
    back = ep.all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)
    out = back.new_zeros(n_tokens, back.shape[-1])
    return out.index_add(0, routing.token, routing.gate[:, None] * back)


def _ep(rank, world, factor):
    moe = ep.MoE(D, EXPERTS[world], TOP_K, factor)
    x, w = _data(world)
    start = sum(_sizes(world)[:rank])
    x, w = (t[start:start + _sizes(world)[rank]] for t in (x, w))
    x.requires_grad_()
    with CollectiveBytes() as fwd:
        out = ep.expert_parallel_forward(moe, x)
    with CollectiveBytes() as bwd:  # the router's share of the aux loss: the reference averages over groups
        ((out * w).sum() + AUX * moe.aux_loss / world).backward()
    grads = {n: p.grad.numpy() for n, p in moe.named_parameters() if p.grad is not None}
    return {"out": out.detach().numpy(), "dx": x.grad.numpy(), "grads": grads, "dropped": moe.dropped,
            "traffic": moe.traffic, "fwd": fwd.bytes_by_kind.get("all_to_all"),
            "bwd": bwd.bytes_by_kind.get("all_to_all")}


def _every_check():
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {factor: _ep(rank, world, factor) for factor in FACTORS}
    ep.combine = _wrong_combine  # this forked rank's module only
    results["wrong combine"] = _ep(rank, world, None)["out"]
    try:
        ep.expert_parallel_forward(ep.MoE(D, 5, TOP_K), torch.zeros(3, D))
    except ValueError as e:
        results["error"] = str(e)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_expert_parallel_equals_one_process(world):
    ranks = run_forked(_every_check, world, timeout=120)
    E, local = EXPERTS[world], EXPERTS[world] // world
    for factor in FACTORS:
        out, dx, dropped, grads = _reference(world, factor)
        got = [r[factor] for r in ranks]
        torch.testing.assert_close(torch.cat([torch.from_numpy(g["out"]) for g in got]), out, msg=f"out {factor}")
        torch.testing.assert_close(torch.cat([torch.from_numpy(g["dx"]) for g in got]), dx, msg=f"dx {factor}")
        assert sum(g["dropped"] for g in got) == dropped and (dropped > 0) == (factor is not None)
        # the router is on every rank, its gradient summed over them; expert e only on its owner
        torch.testing.assert_close(sum(torch.from_numpy(g["grads"]["router.weight"]) for g in got),
                                   grads["router.weight"], msg=f"router {factor}")
        for name, want in grads.items():
            if name.startswith("experts."):
                e = int(name.split(".")[1])
                owner = got[e // local]["grads"]
                torch.testing.assert_close(torch.from_numpy(owner[name]), want, msg=f"{name} {factor}")
                assert all(name not in g["grads"] for i, g in enumerate(got) if i != e // local)
        # split sizes: what rank s sends to r is what r receives from s; bytes: what the formula says
        for r, g in enumerate(got):
            t = g["traffic"]
            assert t["recv_splits"] == [o["traffic"]["send_splits"][r] for o in got]
            assert t["dispatched"] == _sizes(world)[r] * TOP_K - g["dropped"]
            want = ep_cost.ep_bytes_per_rank(t["dispatched"], t["received"], D, 4, E)
            assert g["fwd"] == want["counts"] + want["dispatch"] + want["combine"] and g["bwd"] == want["backward"]
    # the known mistakes: the comparison catches them
    out = _reference(world, None)[0]
    assert not torch.allclose(torch.cat([torch.from_numpy(r["wrong combine"]) for r in ranks]), out, atol=1e-3)
    capped = _reference(world, 1.0)[0]  # capacity ignored: the uncapped layer's output is not the capped one's
    assert not torch.allclose(torch.cat([torch.from_numpy(r[None]["out"]) for r in ranks]), capped, atol=1e-3)
    assert all("5 experts do not split over" in r["error"] for r in ranks) == (5 % world != 0)


def _dispatch_without_counts(tokens, routing, n_experts, group=None):
    """The known mistake: split sizes not exchanged, each rank expecting to receive what it sends."""
    world = torch.distributed.get_world_size(group)
    order = torch.argsort(routing.expert, stable=True)
    counts = torch.bincount(routing.expert, minlength=n_experts).view(world, -1)
    splits = counts.sum(1).tolist()
    return ep.all_to_all(tokens[routing.token[order]], splits, splits, group), ep.Plan(order, splits, splits, counts)


def _without_counts():
    ep.dispatch = _dispatch_without_counts
    torch.manual_seed(0)  # fixed routing: unseeded, the ranks' split sizes could happen to agree and nothing fails
    return ep.expert_parallel_forward(ep.MoE(D, 4, TOP_K, None), torch.randn(5 + dist.get_rank(), D)).shape


def test_split_sizes_not_exchanged_fail_loudly():
    # ranks with different token counts disagree on the sizes: gloo fails the all-to-all, either raising in
    # it or aborting the process (SIGABRT, exit code -6) on "Received data size doesn't match expected size"
    with pytest.raises(WorkerError, match="all_to_all_single|exit code -6"):
        run_forked(_without_counts, 2, timeout=30)


def test_capacity_and_dropped_tokens():
    assert ep.capacity(10, 4, 2, 1.25) == math.ceil(1.25 * 10 * 2 / 4) == 7
    assert ep.capacity(10, 4, 2, None) == 20
    moe = ep.MoE(D, 4, TOP_K, capacity_factor=0.5)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(2))
    r, unlimited = moe.route(x), ep.MoE(D, 4, TOP_K, capacity_factor=None).route(x)
    counts = torch.bincount(unlimited.expert, minlength=4)  # the choices before capacity
    cap = ep.capacity(12, 4, TOP_K, 0.5)
    assert r.dropped == int((counts - cap).clamp_min(0).sum()) > 0 and unlimited.dropped == 0
    assert (torch.bincount(r.expert, minlength=4) <= cap).all()
    # the kept choices of an expert are the first of its queue: every first choice, in token order, then seconds
    for e in range(4):
        assert torch.equal(r.token[r.expert == e], unlimited.token[unlimited.expert == e][:cap])
    first_choices = unlimited.expert[:12]  # the queue starts with every token's first choice
    assert torch.equal(first_choices, moe.router(x).argmax(-1))


def test_balance_loss_and_determinism():
    a, b = ep.MoE(D, 4, TOP_K, seed=3), ep.MoE(D, 4, TOP_K, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.router.weight, ep.MoE(D, 4, TOP_K, seed=4).router.weight)
    torch.nn.init.zeros_(a.router.weight)  # a uniform router: the Switch loss is exactly 1
    assert a.route(torch.randn(6, D)).aux_loss.item() == pytest.approx(1.0)
    with torch.no_grad():  # a router that sends everything to expert 0 scores higher
        b.router.weight.zero_()
        b.router.weight[0] = 10.0
    assert b.route(torch.ones(6, D)).aux_loss.item() > 1.5


def test_groups_and_bad_input():
    moe = ep.MoE(D, 4, TOP_K, capacity_factor=None)
    x = torch.randn(2, 6, D)
    torch.testing.assert_close(moe(x), moe(x, groups=[5, 7]))  # nothing dropped: grouping changes nothing
    with pytest.raises(ValueError, match="equal groups"):
        moe(x, groups=5)
    with pytest.raises(ValueError, match="sum to"):
        moe(x, groups=[5, 5])
    with pytest.raises(ValueError, match="top_k"):
        ep.MoE(D, 2, 3)


def test_the_visible_checks_capacity_answers_are_the_rule_s():
    """checks/nb17's written-out answers of the capacity rule (the student edition cannot compute them: the rule is
    the exercise) are ep.within_capacity's on the visible test's groups, and they drop something."""
    from course_grader.checks import nb17

    seen = []
    for factor in (None, 1.0):
        moe = ep.MoE(nb17.EP_D, 4, nb17.TOP_K, factor)
        x, _ = nb17.ep_data(2)
        for start, size in zip((0, nb17.sizes_of(2)[0]), nb17.sizes_of(2)):
            moe.route(x[start:start + size], keep=lambda e, n, cap: seen.append((e, n, cap)) or
                                torch.ones_like(e, dtype=torch.bool))
    for expert, n, cap in seen:
        assert torch.equal(nb17.visible_keep(expert, n, cap), ep.within_capacity(expert, n, cap))
    assert {(tuple(e.tolist()), cap) for e, _, cap in seen if cap < len(e)} == set(nb17.VISIBLE_KEPT)
    assert all("0" in kept for kept in nb17.VISIBLE_KEPT.values())


# ---------------------------------------------------------------- what current MoEs do: dropless, bias, gates
def _loss_and_grads(moe, x, forward):
    moe.zero_grad()
    x = x.clone().requires_grad_()
    out = forward(moe, x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("experts, top_k, tokens", [(4, 2, 20), (8, 2, 33), (6, 3, 7)])
def test_dropless_grouped_experts_equal_the_layer_without_capacity(experts, top_k, tokens):
    moe = ep.MoE(16, experts, top_k, capacity_factor=None, seed=3)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(4))
    want = _loss_and_grads(moe, x, lambda m, t: m(t))
    got = _loss_and_grads(moe, x, ep.dropless_forward)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert set(got[2]) == set(want[2]) and "router.weight" in got[2]
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)
    assert moe.dropped == 0 and int(moe.load.sum()) == tokens * top_k


def test_grouped_mm_multiplies_each_group_by_its_own_matrix():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    counts = torch.tensor([5, 0, 7])  # an expert no row chose
    want = torch.cat([x[:5] @ w[0], x[5:] @ w[2]])
    torch.testing.assert_close(ep.grouped_mm(x, w, counts), want)
    if hasattr(torch, "_grouped_mm"):  # torch's kernel, where this torch has it: the same product (its forward)
        torch.testing.assert_close(torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32)), want)


def test_renormalised_gates_sum_to_one_and_only_rescale_each_token():
    x = torch.randn(30, D, generator=torch.Generator().manual_seed(2))
    raw, renorm = (ep.MoE(D, 8, 2, None, seed=1, normalize_gates=n) for n in (False, True))
    r_raw, r_norm = raw.route(x), renorm.route(x)
    assert torch.equal(r_raw.expert, r_norm.expert) and torch.equal(r_raw.token, r_norm.token)
    sums = torch.zeros(30).index_add(0, r_norm.token, r_norm.gate)
    torch.testing.assert_close(sums, torch.ones(30))
    raw_sums = torch.zeros(30).index_add(0, r_raw.token, r_raw.gate)
    assert float(raw_sums.max()) < 1  # the top 2 of 8 probabilities: less than all of them
    with torch.no_grad():
        torch.testing.assert_close(renorm(x), raw(x) / raw_sums[:, None])


def test_the_score_bias_picks_experts_but_never_weighs_them():
    moe = ep.MoE(D, 4, 1, None, seed=0)
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(moe.router(x).float(), -1)
    assert torch.equal(moe.route(x).expert, probs.argmax(-1))  # no bias: the largest probability
    moe.update_bias(torch.tensor([10, 0, 0, 30]), rate=1.0)  # experts 1 and 2 below the mean load of 10
    assert moe.score_bias.tolist() == [0.0, 1.0, 1.0, -1.0]
    r = moe.route(x)
    assert set(r.expert.tolist()) <= {1, 2}  # a bias of 1 outweighs any difference of probabilities
    torch.testing.assert_close(r.gate, probs[r.token, r.expert])  # the gate is still the router's probability


def test_the_bias_balances_like_the_switch_loss_without_touching_the_router():
    runs = ep.balancing_runs(32, 8, 2, tokens=96, steps=30, seed=1)
    late = {way: sum(run["imbalance"][-10:]) / 10 for way, run in runs.items()}
    assert runs["none"]["imbalance"][0] > 1.8 and late["none"] > 1.8  # the skewed tokens, never balanced
    assert late["Switch loss"] < 1.5 and late["score bias"] < 1.5
    assert runs["score bias"]["router_change"] == 0 and runs["none"]["router_change"] == 0
    assert runs["Switch loss"]["router_change"] > 0.01
