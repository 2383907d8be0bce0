"""Notebook 02 (FP8) executes on the CPU tier and measures what it claims."""

import pytest
import torch

from recorded import claim, value
from course_lib import fp8


def test_fp8_formats_are_read_from_torch_and_casts_measured(executed):
    res = executed("02_fp8")
    assert (value(res, "e4m3_max"), value(res, "e5m2_max")) == (448.0, 57344.0)
    assert value(res, "e4m3_smallest_subnormal") == 2.0**-9 and value(res, "e5m2_smallest_subnormal") == 2.0**-16
    assert (value(res, "e4m3_mantissa_bits"), value(res, "e5m2_mantissa_bits")) == (3, 2)
    assert value(res, "e5m2_cast_of_2x_max") == "inf"
    assert value(res, "e4m3_cast_of_2x_max") in ("saturates to 448", "nan")  # e4m3fn has no inf: torch decides
    assert value(res, "e4m3_of_2^-10") == 0.0 and value(res, "e5m2_of_1e5") is None  # None: inf, stored as JSON
    assert value(res, "e4m3_of_0.02") == 0.01953125  # a normal number: 1.25 × 2^-6, above the smallest normal 2^-6
    assert value(res, "e4m3_smallest_normal") == 2.0**-6 < 0.02


def test_fnuz_formats_are_in_the_table_with_torchs_max(executed):
    res = executed("02_fp8")
    assert value(res, "format_table_max") == {name: float(torch.finfo(dt).max) for name, dt in fp8.TABLE_DTYPES.items()}
    assert (value(res, "e4m3fnuz_max"), value(res, "e5m2fnuz_max")) == (240.0, 57344.0)
    assert value(res, "e4m3fnuz_smallest_subnormal") == 2.0**-10
    assert value(res, "e5m2fnuz_smallest_subnormal") == 2.0**-17
    assert (value(res, "e4m3fnuz_mantissa_bits"), value(res, "e5m2fnuz_mantissa_bits")) == (3, 2)
    for name in ("e4m3fnuz", "e5m2fnuz"):  # one NaN, no inf, no -0; a cast past max is that NaN
        assert (value(res, f"{name}_nan_patterns"), value(res, f"{name}_has_inf"),
                value(res, f"{name}_has_negative_zero")) == (1, False, False)
        assert value(res, f"{name}_cast_of_2x_max") == "nan"
    assert value(res, "e4m3fnuz_of_480_is_nan") is True
    assert value(res, "e4m3_has_negative_zero") is True and value(res, "e4m3_has_inf") is False


def test_about_half_of_std_002_weights_are_subnormal_in_e4m3(executed):
    res = executed("02_fp8")
    # N(0, 0.02): |w| < 2^-6 (minus half a subnormal step) is subnormal in e4m3fn, |w| <= 2^-10 rounds to 0
    assert 0.47 < value(res, "e4m3_normal_0.02_subnormal_fraction") < 0.53
    assert 0.035 < value(res, "e4m3_normal_0.02_zero_fraction") < 0.045
    # e4m3fnuz's smallest normal is an octave lower (2^-7): fewer subnormals, half as many zeros
    assert 0.24 < value(res, "e4m3fnuz_normal_0.02_subnormal_fraction") < 0.29
    assert 0.017 < value(res, "e4m3fnuz_normal_0.02_zero_fraction") < 0.022


def test_fp8_matmul_error_and_the_need_for_a_scale(executed):
    res = executed("02_fp8")
    err = {k: value(res, f"matmul_error_{k}")
           for k in ("fp16", "bf16", "e4m3_unscaled", "e4m3_scaled", "e5m2_e4m3_scaled")}
    assert err["fp16"] < err["bf16"] < 0.005 < err["e4m3_scaled"] < 0.06
    assert err["e4m3_scaled"] < err["e5m2_e4m3_scaled"]
    assert err["e4m3_unscaled"] > 1.3 * err["e4m3_scaled"]
    assert 8 < value(res, "e4m3_scaled_vs_bf16_error_ratio") < 32, "3 mantissa bits against 7: about 16x coarser"
    assert value(res, "e4m3_weights_zero_unscaled") > 0.01 and value(res, "e4m3_weights_subnormal_unscaled") > 0.3
    unscaled, scaled = value(res, "sweep_e4m3_unscaled"), value(res, "sweep_e4m3_scaled")
    # flushed, saturated, fine between
    assert unscaled[0] > 0.9 and unscaled[-1] > 0.9 and min(unscaled) < 2 * min(scaled)
    assert max(scaled) < 1.1 * min(scaled) and max(value(res, "sweep_bf16")) < 0.005
    assert value(res, "matmul_error_path") in ("torch._scaled_mm", "emulated: dequantized to float32, float32 matmul")
    assert claim(res, "FP8: 8 bits, range limited")["held"]
    assert claim(res, "FP8 comes at a cost of precision")["held"]


def test_fp8_speed_claim_follows_the_timing(executed):
    res = executed("02_fp8")
    ratio = value(res, "fp8_matmul_speedup_vs_bf16")
    assert ratio == pytest.approx(value(res, "bf16_matmul_ms") / value(res, "fp8_matmul_ms"), rel=1e-9)
    speed = claim(res, "FP8 can help speed up training some; cutting edge")
    assert value(res, "fp8_matmul_speed_path") in speed["measured"]
    if value(res, "fp8_matmul_speed_path") == "torch._scaled_mm":  # FP8 units: a verdict
        assert speed["kind"] == "measured" and speed["held"] == (ratio >= 1.2)
    else:  # emulated: the timing is the emulation's, so the claim is not measured here
        assert speed["kind"] == "not measured here" and speed["held"] is None, speed


def test_the_notebooks_delayed_scaler_saturates_on_the_spike(executed):
    res = executed("02_fp8")
    # each scale the notebook's DelayedScalingFP8 used is the smallest current-scaling scale of the 8 steps before
    assert value(res, "your_delayed_scales_are_current_scales_run_late") is True
    assert value(res, "delayed_saturated_at_spike") > 0.3 and value(res, "delayed_all_finite") is True
    assert value(res, "delayed_error_at_spike") > 10 * value(res, "current_error_at_spike")
    assert value(res, "current_saturated_max") == 0.0 and value(res, "delayed_fill_after_spike") < 0.5


def test_fp8_training_is_recorded_only_where_it_ran(executed):
    res = executed("02_fp8")  # the CPU tier: the torchao comparison needs an FP8 GPU
    assert not [k for k in res["values"] if k.startswith("llama_")]
    training = [c for c in res["claims"] if "Llama 3.1 8B shape" in c["claim"]]  # said, with no verdict
    assert len(training) == 1 and training[0]["kind"] == "not measured here" and training[0]["held"] is None
    assert len(res["figures"]) >= 2  # the matmul error sweep, the delayed scaler's trace
