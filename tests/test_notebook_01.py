"""Notebook 01 (mixed precision) executes on the CPU tier and measures what it claims."""

import math

import pytest

from recorded import claim, value


def test_formats_overflow_and_underflow(executed):
    res = executed("01_mixed_precision")
    assert value(res, "fp16_max") == 65504.0
    assert value(res, "bf16_max") > 3e38
    assert value(res, "fp16_65504_times_2_is_inf") is True
    assert value(res, "bf16_65504_times_2") == 131072.0
    assert value(res, "fp16_of_1e-8") == 0.0
    assert abs(value(res, "bf16_of_1e-8") - 1e-8) < 1e-10
    assert claim(res, "FP16 range")["held"]


def test_loss_scaling_moves_gradients_into_fp16_range(executed):
    res = executed("01_mixed_precision")
    unscaled = value(res, "fp16_subnormal_fraction_unscaled") + value(res, "fp16_zero_fraction_unscaled")
    assert unscaled > 0.05, "without scaling a visible share of activation gradients is subnormal or zero in fp16"
    assert value(res, "fp16_subnormal_fraction_scale_2^16") < unscaled / 10
    assert value(res, "bf16_zero_fraction_unscaled") == 0.0


def test_the_notebooks_own_scaler_skips_overflowing_steps_and_backs_off(executed):
    res = executed("01_mixed_precision")
    assert value(res, "your_scaler_matches_gradscaler") is True  # DynamicLossScaler's trace is GradScaler's
    trace = value(res, "fp16_scale_trace_log2")
    start = value(res, "fp16_init_scale_log2")
    assert trace[0] == start
    assert value(res, "fp16_skipped_steps_big_init_scale") >= 3
    assert max(trace[1:]) < start and min(trace) <= start - 3, "the scale must have backed off"
    assert all(abs(b - a) in (0.0, 1.0) for a, b in zip(trace, trace[1:])), \
        "the scale halves or doubles, one step at a time"
    assert claim(res, "FP16: range")["held"]


def test_autocast_memory_and_the_speed_claim_is_recorded(executed):
    res = executed("01_mixed_precision")
    # 16-bit activations halve, int64 max-pool indices and fp32 GroupNorm statistics do not: between 1.4x and 2x
    for dt in ("float16", "bfloat16"):
        assert 1.4 < value(res, f"activation_ratio_{dt}") < 2.0
    assert claim(res, "Mixed precision: 2x memory")["held"]
    # the speed claim is recorded either way (on a CPU it usually does not hold): no timing is asserted, but
    # its speed-ups are the recorded step times' ratios, and its verdict is the one those ratios give
    for dt in ("float16", "bfloat16"):
        want = value(res, "step_ms_float32") / value(res, f"step_ms_{dt}")
        assert value(res, f"speedup_{dt}") == pytest.approx(want, rel=1e-9)
    speed = claim(res, "Mixed precision: 2x speed (1 GPU), against PyTorch's default float32")
    best = max(value(res, "speedup_float16"), value(res, "speedup_bfloat16"))
    assert f"{value(res, 'speedup_bfloat16'):.2f}x (bf16)" in speed["measured"]
    assert speed["held"] == (best >= 1.5)


def test_bf16_needs_no_scaler(executed):
    res = executed("01_mixed_precision")
    assert value(res, "bf16_all_losses_finite") is True
    assert value(res, "fp32_loss_drop") > 0.1, "the float32 run must actually learn for the comparison to mean anything"
    assert value(res, "bf16_vs_fp32_final_loss_rel_gap") < 0.05
    assert value(res, "fp16_vs_fp32_final_loss_rel_gap") < 0.05
    assert claim(res, "BF16: no loss scaling")["held"]


def test_pure_bf16_weights_lose_small_updates(executed):
    res = executed("01_mixed_precision")
    pure = value(res, "changed_fraction_pure_bf16")
    master = value(res, "changed_fraction_fp32_master")
    assert pure < 0.5 and master > 0.9
    assert abs(value(res, "changed_fraction_predicted_pure_bf16") - pure) < 0.1
    assert value(res, "loss_drop_pure_bf16") < 0.5 * value(res, "loss_drop_fp32_master")
    assert math.isclose(value(res, "model_state_ratio_master_vs_pure"), 2.0, rel_tol=1e-6)
    assert claim(res, "If you use .bf16() weights")["held"]
    assert len(res["figures"]) >= 5
