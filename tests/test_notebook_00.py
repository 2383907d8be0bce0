"""Notebook 00 (orientation and memory anatomy) executes on the CPU tier and measures what it claims."""

from recorded import claim, value

MiB, GiB = 2**20, 2**30


def test_model_state_estimate_is_exact(executed):
    res = executed("00_orientation")
    for mode in ("fp32", "autocast", "pure_bf16"):
        # weights, gradients and Adam states are tensors of known size: the estimate is exact
        assert value(res, f"{mode}_model_state_measured_over_estimate") == 1.0, mode
    n = value(res, "n_params")
    assert value(res, "fp32_model_state_measured_bytes") == 16 * n
    # autocast keeps float32 master weights: no saving in the model state
    assert value(res, "autocast_model_state_measured_bytes") == value(res, "fp32_model_state_measured_bytes")
    assert value(res, "pure_bf16_model_state_measured_bytes") == 8 * n


def test_activation_estimates(executed):
    res = executed("00_orientation")
    # float32: the census of saved tensors is close to the 10d + 4ffn rule
    assert 0.85 < value(res, "fp32_activation_measured_over_estimate") < 1.15
    # autocast keeps the residual stream, norms and logits in float32 and saves bf16 weight copies:
    # clearly more than the 2-bytes-per-value estimate, but still less than fp32
    assert value(res, "autocast_activation_measured_over_estimate") > 1.1
    assert value(res, "autocast_activation_measured_bytes") < value(res, "fp32_activation_measured_bytes")
    assert 0.9 < value(res, "pure_bf16_activation_measured_over_estimate") < 1.3


def test_seed003_tables_rebuilt(executed):
    res = executed("00_orientation")
    # bert-base-cased: every cell of the seed's table within its printed rounding
    assert value(res, "bert_max_rel_diff_vs_seed") < 0.005
    assert abs(value(res, "bert_fp32_highest_bytes") / GiB - 1.61) < 0.005
    # Llama-3-8B: today's config is 0.25 GiB of 2024 buffers short; adding them reproduces the seed
    assert abs(value(res, "llama3_8b_fp32_highest_bytes") / GiB - 111.83) < 0.01
    assert abs(value(res, "llama3_8b_model_gap_to_seed_bytes") / GiB - 0.25) < 0.006
    assert 0.005 < value(res, "llama3_8b_max_rel_diff_vs_seed") < 0.01
    assert value(res, "llama3_8b_with_caches_max_rel_diff_vs_seed") < 0.0005
    # the estimator's AutoModel leaves out the 525M-parameter lm_head of the 8.03B model
    assert value(res, "llama3_8b_params") == 8_030_261_248
    assert value(res, "llama3_8b_params") - value(res, "llama3_8b_params_without_lm_head") == 128256 * 4096


def test_claims_and_figures(executed):
    res = executed("00_orientation")
    assert claim(res, "fp32 Adam training holds 4x the model size: "
                      "1x weights, 1x gradients, 2x optimizer states")["held"]
    assert claim(res, "mixed precision (autocast) keeps the weights in full precision")["held"]
    assert claim(res, "bert-base-cased fp32 training needs 1.61 GB")["held"]
    # what the measurement contradicts
    assert claim(res, "bert-base-cased mixed-precision training needs half the memory of fp32")["held"] is False
    # the 8B rows are arithmetic on a config (nothing of 8B parameters runs here): predictions, not verdicts
    for text, agrees in (("Llama-3-8B fp32 training needs 112.84 GB", True),
                         ("the Llama-3-8B table is for the 8.03B-parameter model", False)):
        found = claim(res, text)
        assert (found["kind"], found["held"], found["agrees"]) == ("predicted", None, agrees), found
    # the allocator's snapshot needs a GPU's caching allocator: on the CPU tier it says so and decides nothing
    snapshot = claim(res, "The allocator's snapshot replays to the peak")
    assert (snapshot["kind"], snapshot["held"]) == ("not measured here", None), snapshot
    assert "snapshot_peak_bytes" not in res["values"]
    assert {c["kind"] for c in res["claims"]} == {"measured", "predicted", "not measured here"}
    assert len(res["figures"]) >= 2
    assert value(res, "collective_backend") in ("gloo", "nccl", "nccl (RCCL)")


def test_the_notebooks_meter_and_a_measured_bert_step(executed):
    res = executed("00_orientation")
    for mode in ("fp32", "autocast", "pure_bf16"):
        assert value(res, f"{mode}_your_meter_minus_course_lib_bytes") == 0, mode  # saved_activation_bytes
    ratio = value(res, "fp32_activations_over_model_state")
    assert ratio == value(res, "fp32_activation_measured_bytes") / value(res, "fp32_model_state_measured_bytes")
    # bert-base-cased: 108.3 M parameters x 16 bytes = 1.61 GiB of model state, plus activations
    state, total = value(res, "bert_fp32_measured_state_bytes"), value(res, "bert_fp32_measured_total_bytes")
    assert abs(state / GiB - 1.614) < 0.005 and state < total < 1.2 * state
    assert claim(res, "bert-base-cased fp32 training needs 1.61 GB")["held"]
    assert value(res, "bert_autocast_over_fp32_measured") > 0.9  # autocast keeps the fp32 state: not half
