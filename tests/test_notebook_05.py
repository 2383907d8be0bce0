"""Notebook 05 (FSDP) executes on the CPU tier and measures what it claims."""

from conftest import value


def test_sharded_training_equals_one_process(executed):
    res = executed("05_fsdp")
    for s in ("full", "grad_op", "no_shard", "hybrid"):
        assert 0 <= value(res, f"{s}_vs_single_loss_max_rel_diff") < 1e-5, s
    assert all(c["held"] for c in res["claims"]), res["claims"]


def test_full_shard_holds_one_nth_per_rank(executed):
    res = executed("05_fsdp")
    assert abs(value(res, "full_shard_total_over_ideal") - 1) < 0.10
    assert abs(value(res, "full_shard_ranks_sum_over_estimate") - 1) < 1e-9  # shards add up to one copy
    assert value(res, "full_shard_bytes_per_rank") < 0.6 * value(res, "estimate_total_bytes")
    assert value(res, "grad_op_weights_in_backward_over_full") > 0.99
    assert abs(value(res, "no_shard_total_over_estimate") - 1) < 0.01


def test_policies_and_meta_init(executed):
    res = executed("05_fsdp")
    assert 1e-7 < value(res, "bf16_policy_vs_fp32_loss_max_rel_diff") < 1e-2
    assert value(res, "offload_vs_full_loss_max_rel_diff") < 1e-5
    assert value(res, "meta_init_vs_normal_loss_max_rel_diff") < 1e-6


def test_dcp_checkpoint_resumes_exactly(executed):
    res = executed("05_fsdp")
    assert value(res, "resume_vs_uninterrupted_loss_max_abs_diff") == 0
    assert value(res, "resume_digest_rel_diff") == 0
    assert value(res, "resume_start_step") == 4
    assert value(res, "checkpoint_rank_files") == 2
    assert len(res["figures"]) >= 3
