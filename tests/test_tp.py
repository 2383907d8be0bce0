"""course_lib.parallel.tp, tp_torch and tp_cost on real gloo ranks: Megatron's pair against the unsplit layers (and
the mistakes that break it), the hand and torch tensor-parallel Llamas and DP×TP against one process, the bytes
counted against the formulas.

Ranks are forked (``run_forked``); the tiny Llama, short sequences and few steps keep 4 ranks on 2 cores fast.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel import ddp_cost, tp, tp_cost, tp_torch
from course_lib.distributed import CollectiveBytes
from course_lib.launch import run_forked
from course_lib.models import build_llama

B, T = 2, 8
build_llama("tiny")  # import transformers' Llama once here: every forked rank inherits it instead of importing it again


def _close(a, b, rel=1e-5) -> bool:
    return torch.allclose(a, b, rtol=rel, atol=rel * float(b.abs().max()))


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _split_dim(layer: nn.Module, name: str):
    if isinstance(layer, tp.ColumnParallelLinear):
        return 0  # rows, bias too
    return 1 if isinstance(layer, tp.RowParallelLinear) and name == "weight" else None  # a row layer's bias is whole


def _grads_match(split: nn.Module, whole: nn.Module) -> bool:
    """Every gradient of a split block, gathered along its split dim, equals the unsplit block's."""
    ok = True
    for name, p in split.named_parameters():
        owner, _, leaf = name.rpartition(".")
        dim = _split_dim(split.get_submodule(owner), leaf)
        ok &= _close(p.grad if dim is None else _gathered(p.grad, dim), whole.get_parameter(name).grad)
    return ok


def _run(block: nn.Module, x: torch.Tensor, **kwargs):
    """Output and input gradient of ``block`` on ``x`` (same loss on every rank)."""
    x = x.clone().requires_grad_()
    out = block(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad


def _pair_and_blocks():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    d, h = 12, 8 * world
    first, second = nn.Linear(d, h), nn.Linear(h, d)
    x = torch.randn(B, T, d)
    ref_out, ref_dx = _run(nn.Sequential(first, second), x)
    pair = nn.Sequential(tp.ColumnParallelLinear.from_linear(first, rank, world),
                         tp.RowParallelLinear.from_linear(second, rank, world))
    out, dx = _run(pair, x)
    result = {"pair": _close(out, ref_out) and _close(dx, ref_dx) and _grads_match(pair, nn.Sequential(first, second))}

    model = build_llama("tiny", num_key_value_heads=max(2, world))  # TP 4 needs 4 K/V heads
    layer, x = model.model.layers[0], torch.randn(B, T, 64)
    pos = model.model.rotary_emb(x, torch.arange(T)[None])
    ref_mlp = _run(layer.mlp, x)
    ref_attn = _run(layer.self_attn, x, position_embeddings=pos, attention_mask=None)
    split = build_llama("tiny", num_key_value_heads=max(2, world)).model.layers[0]
    tp.parallelize_mlp(split.mlp, rank, world)
    tp.parallelize_attention(split.self_attn, rank, world)
    with CollectiveBytes() as counted:
        mlp = _run(split.mlp, x)
    attn = _run(split.self_attn, x, position_embeddings=pos, attention_mask=None)
    result["mlp"] = all(_close(a, b) for a, b in zip(mlp, ref_mlp)) and _grads_match(split.mlp, layer.mlp)
    result["attention"] = (all(_close(a, b) for a, b in zip(attn, ref_attn))
                           and _grads_match(split.self_attn, layer.self_attn))
    result["mlp_bytes"] = (counted.calls_by_kind, counted.bytes_by_kind)
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_column_row_pair_and_llama_blocks_equal_the_unsplit_ones(world):
    """Outputs, input gradients and every weight gradient (gathered) within 1e-5; the MLP costs 2 all-reduces."""
    for r in run_forked(_pair_and_blocks, world, timeout=120):
        assert r["pair"] and r["mlp"] and r["attention"], r
        # one all-reduce forward (down's g), one backward (the block input's f), of B×T×hidden fp32 values each
        assert r["mlp_bytes"] == ({"all_reduce": 2}, {"all_reduce": 2 * B * T * 64 * 4}), r["mlp_bytes"]


class _BiasEverywhere(tp.RowParallelLinear):
    def forward(self, x):
        return tp.reduce_from_tp(nn.functional.linear(x, self.weight, self.bias), self.group)


class _ReducedColumn(tp.ColumnParallelLinear):
    def forward(self, x):
        return tp.reduce_from_tp(super().forward(x), self.group)


class _NoCopy(tp.ColumnParallelLinear):
    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def _mistakes():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    first, second = nn.Linear(6, 8), nn.Linear(8, 4)
    x = torch.randn(B, 6)
    ref_out, ref_dx = _run(nn.Sequential(first, second), x)
    wrong = {}
    for name, column, row in (("bias on every rank", tp.ColumnParallelLinear, _BiasEverywhere),
                              ("all-reduce in both layers", _ReducedColumn, tp.RowParallelLinear),
                              ("no f before the column layer", _NoCopy, tp.RowParallelLinear)):
        pair = nn.Sequential(column.from_linear(first, rank, world), row.from_linear(second, rank, world))
        out, dx = _run(pair, x)
        wrong[name] = _close(out, ref_out) and _close(dx, ref_dx) and _grads_match(pair, nn.Sequential(first, second))
    # seed 002: a plain all_gather after the first layer, then an unsplit second layer
    first.zero_grad(), second.zero_grad()
    naive = tp.ColumnParallelLinear.from_linear(first, rank, world, gather_output=True, gather=tp.naive_gather)
    out = second(naive(x.clone().requires_grad_()))
    out.sum().backward()
    right = tp.ColumnParallelLinear.from_linear(first, rank, world, gather_output=True)
    second(right(x)).sum().backward()
    return {"wrong": wrong, "naive_first_grad": naive.weight.grad, "naive_out_requires_grad": out.requires_grad,
            "right_first_grad": float(right.weight.grad.abs().sum())}


def test_common_mistakes_give_wrong_outputs_or_gradients_and_the_naive_gather_loses_the_gradient():
    for r in run_forked(_mistakes, 2, timeout=60):
        assert not any(r["wrong"].values()), f"a mistake matched the unsplit layers: {r['wrong']}"
        assert r["naive_first_grad"] is None  # seed 002's trap: the first layer's weights learn nothing
        assert r["naive_out_requires_grad"]  # (the second layer still trains: the loss has a gradient)
        assert r["right_first_grad"] > 0


def test_sizes_that_do_not_split_say_what_to_change():
    with pytest.raises(ValueError, match="out_features=13 does not divide by the tensor-parallel size 4"):
        tp.ColumnParallelLinear(8, 13, world=4)
    with pytest.raises(ValueError, match="in_features=6 does not divide"):
        tp.RowParallelLinear(6, 8, world=4)
    attn = build_llama("tiny").model.layers[0].self_attn  # 4 heads, 2 K/V heads
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        tp.parallelize_attention(attn, 0, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by the tensor-parallel size 3"):
        tp.check_heads(4, 4, 3)
    tied = build_llama("tiny", tie_word_embeddings=True)  # torch's plan would split the shared weight two ways
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        tp_torch.apply_tp(tied, None, tp_torch.TPRun())


def _train_runs(runs):
    return {label: tp_torch.train(spec) for label, spec in runs.items()}


def test_hand_and_torch_tensor_parallel_llamas_train_like_one_process_on_2_ranks():
    """5 AdamW steps: hand TP, torch TP with sequence parallelism, and without it but with loss parallel."""
    base = tp_torch.TPRun(steps=5, batch=4, seq=16)
    runs = {"single": replace(base, mode="single"), "hand": replace(base, mode="hand"), "torch": base,
            "torch, no SP, loss parallel": replace(base, sequence_parallel=False, loss_parallel=True)}
    ranks = run_forked(_train_runs, 2, dict(runs=runs), timeout=120)
    reference = ranks[0]["single"]["losses"]
    assert len(reference) == 5 and reference[-1] < reference[0]
    for r in ranks:
        for label in runs:
            assert r[label]["losses"] == pytest.approx(reference, rel=1e-5), label
    hand = ranks[0]["hand"]  # 2 layers × (attention + MLP) × (forward + backward) all-reduces of B×T×d fp32
    assert hand["calls_by_kind"] == {"all_reduce": 8}
    assert hand["bytes_by_kind"]["all_reduce"] == 8 * 4 * 16 * 64 * 4 == tp_cost.tp_bytes_per_rank(2, 4 * 16, 64)
    assert set(hand["bytes_by_kind"]) == {"all_reduce"}
    # sequence parallelism: each block's all-reduce becomes an all-gather before and a reduce-scatter after
    assert {"all_gather", "reduce_scatter"} <= set(ranks[0]["torch"]["calls_by_kind"])
    assert ranks[0]["torch, no SP, loss parallel"]["calls_by_kind"]["all_reduce"] >= 10


def test_torch_tp_and_dp_by_tp_on_4_ranks_train_like_one_process():
    """TP 4 (a config with 4 K/V heads) and a (dp 2, tp 2) mesh with FSDP2 over dp: the losses of one process."""
    base = tp_torch.TPRun(steps=5, batch=4, seq=16, num_key_value_heads=4)
    runs = {"single": replace(base, mode="single"), "torch": replace(base, mode="torch"),
            "dp_tp": replace(base, mode="dp_tp", dp=2)}
    ranks = run_forked(_train_runs, 4, dict(runs=runs), timeout=180)
    reference = ranks[0]["single"]["losses"]
    for r in ranks:
        assert r["torch"]["losses"] == pytest.approx(reference, rel=1e-5)
        assert r["dp_tp"]["losses"] == pytest.approx(reference, rel=1e-5)
    groups = ranks[0]["dp_tp"]["bytes_by_group"]
    assert set(groups["dp"]) == {"all_gather", "reduce_scatter"}, groups  # FSDP2 over dp
    assert groups["tp"]["reduce_scatter"] > 0 and groups["tp"]["all_gather"] > 0, groups  # TP with SP over tp


def test_bytes_per_step_per_dimension_are_counted_and_match_the_formulas():
    """DDP, FSDP2, torch TP (sequence parallel) and DP×TP on 4 launched ranks: one step's collectives, counted."""
    from course_lib.models import llama_config, llama_num_parameters

    batch, seq, d, vocab = 4, 16, 64, 512
    counted = tp_torch.comm_bytes(replace(tp_torch.COMM_RUN, batch=batch, seq=seq, num_key_value_heads=4), nprocs=4)
    params = 4 * llama_num_parameters(llama_config("tiny", num_key_value_heads=4))  # fp32 bytes of the whole model
    # DDP's C++ reducer is seen: one bucket here; ddp_bytes_per_rank is notebook 17's DP row
    assert counted["ddp"]["bytes_by_kind"]["all_reduce"] == params == ddp_cost.ddp_bytes_per_rank(params // 4, 4)
    assert counted["dp"]["bytes_by_kind"]["reduce_scatter"] == params  # FSDP2: every gradient reduce-scattered once
    act = batch * seq * d * 4  # one hidden state, fp32
    # torch 2.7's DTensor has no sharding rule for slice_backward (2.8 added one): the backward of transformers'
    # logits slice, hidden_states[:, -logits_to_keep:], gathers the sequence-sharded gradient once more
    from torch.distributed.tensor._ops import _tensor_ops
    slice_gather = 0 if hasattr(_tensor_ops, "slice_backward_rules") else act
    # 2 layers × 2 blocks, embedding and LM head: 5 reduce-scatters and 5 all-gathers forward, mirrored backward;
    # the logits gathered for the loss; the 5 norm weights' gradients all-reduced once (reduce_partial_grads)
    assert counted["tp"]["bytes_by_kind"] == {"reduce_scatter": 10 * act,
                                              "all_gather": 10 * act + batch * seq * vocab * 4 + slice_gather,
                                              "all_reduce": 5 * d * 4}
    dp_tp = counted["dp_tp"]["bytes_by_group"]
    norms = 5 * d * 4  # replicated over tp; every other weight is split in 2 by TP before FSDP2 shards it over dp
    assert dp_tp["dp"]["reduce_scatter"] == (params - norms) // 2 + norms
    assert dp_tp["tp"]["reduce_scatter"] == 10 * act // 2  # the tp dim sees half the global batch
