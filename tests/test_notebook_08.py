"""Notebook 08 (FSDP) executes on the CPU tier and measures what it claims."""

from recorded import value


def test_sharded_training_equals_one_process(executed):
    res = executed("08_fsdp")
    for s in ("full", "grad_op", "no_shard", "hybrid"):
        assert 0 <= value(res, f"{s}_vs_single_loss_max_rel_diff") < 1e-5, s
    assert all(c["held"] for c in res["claims"] if c["kind"] == "measured"), res["claims"]


def test_full_shard_holds_one_nth_per_rank(executed):
    res = executed("08_fsdp")
    assert abs(value(res, "full_shard_total_over_ideal") - 1) < 0.10
    assert abs(value(res, "full_shard_ranks_sum_over_estimate") - 1) < 1e-9  # shards add up to one copy
    assert value(res, "full_shard_bytes_per_rank") < 0.6 * value(res, "estimate_total_bytes")
    assert value(res, "grad_op_weights_in_backward_over_full") > 0.99
    assert abs(value(res, "no_shard_total_over_estimate") - 1) < 0.01


def test_policies_and_meta_init(executed):
    res = executed("08_fsdp")
    assert 1e-7 < value(res, "bf16_policy_vs_fp32_loss_max_rel_diff") < 1e-2
    assert value(res, "offload_vs_full_loss_max_rel_diff") == 0  # where the state lives, not what it computes
    assert value(res, "meta_init_vs_normal_loss_max_rel_diff") < 1e-6


def test_dcp_checkpoint_resumes_exactly(executed):
    res = executed("08_fsdp")
    assert value(res, "resume_vs_uninterrupted_loss_max_abs_diff") == 0
    assert value(res, "resume_digest_rel_diff") == 0
    assert value(res, "resume_start_step") == 4
    assert value(res, "checkpoint_rank_files") == 2
    assert len(res["figures"]) >= 3


def test_every_rank_agrees_and_the_meshes_are_the_strategies(executed):
    res = executed("08_fsdp")
    assert value(res, "ranks_agree_on_losses_and_weights") is True
    assert value(res, "mesh_shapes") == [[2], [2], [2, 1], [2, 1]]  # full, grad_op, no_shard, hybrid on 2 ranks


def test_bytes_per_part_follow_the_strategy(executed):
    res = executed("08_fsdp")
    for part, ratio in value(res, "full_shard_part_over_ideal").items():
        assert abs(ratio - 1) < 0.10, part  # 1/N of the estimate, padding aside
    assert value(res, "grad_op_bytes_equal_full_shard") is True  # it differs only between forward and backward
    assert value(res, "no_shard_bytes_equal_estimate") is True  # DDP: a full copy, exactly


def test_meta_init_builds_one_full_copy_and_the_checkpoint_has_its_metadata(executed):
    res = executed("08_fsdp")
    weights = value(res, "estimate_total_bytes") // 4  # 16 bytes per parameter, 4 of them weights
    assert value(res, "meta_init_full_weights_built_per_rank") == [weights, 0]  # rank 0 alone
    assert value(res, "normal_init_full_weights_built_per_rank") == [weights, weights]
    assert value(res, "checkpoint_has_metadata") is True


def test_the_students_sharding_by_hand_trains_like_one_process_with_half_the_weights(executed):
    res = executed("08_fsdp")
    assert value(res, "hand_sharded_vs_single_loss_max_rel_diff") < 1e-5
    share = value(res, "hand_sharded_bytes_over_full_copy")
    assert 0.5 <= share <= 0.51  # 2 ranks: a padded half of every block


def test_a_traced_fsdp_step_gathers_each_unit_per_pass_and_prefetch_moves_only_the_issue(executed):
    res = executed("08_fsdp")
    units, resharded = value(res, "fsdp_trace_units"), value(res, "fsdp_trace_units_resharded_after_forward")
    assert units == 5 and resharded in (units - 1, units)  # torch 2.7 never reshards the root after forward
    assert value(res, "fsdp_trace_all_gathers") == {"forward": units, "backward": resharded}
    assert value(res, "fsdp_trace_gradient_reductions") == {"gloo:all_reduce": units}  # gloo's reduce-scatter
    paced, early, late = (value(res, f"fsdp_trace_gathers_{what}") for what in ("paced", "early", "late"))
    # after a unit with matmuls: layers.1 and lm_head in forward; layers.1, layers.0 and the embedding in backward
    assert paced["default"] == paced["prefetch"] == {"forward": 2, "backward": 3}
    assert early["prefetch"]["forward"] == 2 and early["default"]["forward"] == 0 and late["default"]["forward"] == 2
    assert early["default"]["backward"] == early["prefetch"]["backward"] == 3  # FSDP2 prefetches backward by default
    assert all(share < 0.01 for share in value(res, "fsdp_trace_all_gather_share_under_matmuls").values())
    assert all(share > 0.99 for share in value(res, "fsdp_trace_all_gather_share_rank_waits").values())
    assert any(c["kind"] == "not measured here" and "CUDA stream" in c["claim"] for c in res["claims"])
    assert any(f.endswith("08_fsdp_fsdp_step_trace.png") for f in res["figures"])
