"""Notebook 14 (tensor parallelism) executes on the CPU tier and measures what it claims."""

from recorded import claim, value


def test_every_cut_trains_the_same_model_as_one_process(executed):
    res = executed("14_tensor_parallelism")
    assert value(res, "tp_steps") >= 5
    for mode in ("ddp", "dp", "hand", "torch", "dp_tp"):
        assert 0 <= value(res, f"tp_loss_gap_{mode}") < 1e-5, mode


def test_the_students_pair_splits_a_llama_mlp(executed):
    res = executed("14_tensor_parallelism")
    assert value(res, "your_pair_llama_mlp_max_diff") < 1e-5  # the Llama MLP split with the student's layers


def test_seed_all_gather_loses_the_gradient(executed):
    res = executed("14_tensor_parallelism")
    assert value(res, "seed_all_gather_loses_gradient") is True
    assert claim(res, "seed 002's ColumnParallelLinear")["held"] is False  # the seed's layer does not train


def test_bytes_per_dimension_are_counted(executed):
    res = executed("14_tensor_parallelism")
    hand, torch_tp, ddp = (value(res, f"bytes_per_step_{m}") for m in ("hand", "torch", "ddp"))
    # the student's layers: 2 layers x (2 all-reduces forward, o and down, + 5 backward, one per column layer: q, k,
    # v, gate, up each copy their own input) of a (4 x 32 x 64) float32 activation
    assert hand == 2 * (2 + 5) * 4 * 32 * 64 * 4
    # torch's plan moves the same activations (reduce-scatter + all-gather) plus the gathered logits
    assert torch_tp > hand
    held = claim(res, "DDP all-reduces every gradient once per step")
    assert held["held"] and ddp >= 4 * 166_208  # + DDP's buffer broadcast
    groups = value(res, "bytes_by_group_dp_tp")
    assert set(groups["dp"]) == {"all_gather", "reduce_scatter"}  # FSDP2 moves weights and gradients over "dp"
    assert {"all_gather", "reduce_scatter"} <= set(groups["tp"])  # sequence-parallel activations over "tp"


def test_claims_and_figures(executed):
    res = executed("14_tensor_parallelism")
    others = [c for c in res["claims"] if not c["claim"].startswith("seed 002's ColumnParallelLinear")]
    assert len(others) >= 3 and all(c["held"] or c["agrees"] for c in others), others
    assert len(res["figures"]) >= 1
