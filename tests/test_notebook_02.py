"""Notebook 02 (gradient accumulation) executes on the CPU tier and measures what it claims."""

from conftest import value


def test_accumulation_equals_big_batch(executed):
    res = executed("02_gradient_accumulation")
    # float32 rounding, not zero and not a bug-sized gap
    assert 0 <= value(res, "accum_vs_big_max_rel_diff") < 1e-5
    # forgetting the division multiplies the gradient by exactly the number of micro-batches
    assert abs(value(res, "undivided_grad_norm_ratio") - 4.0) < 1e-3
    assert all(c["held"] for c in res["claims"]), res["claims"]


def test_bf16_accumulation_is_close_but_not_exact(executed):
    res = executed("02_gradient_accumulation")
    assert 1e-6 < value(res, "bf16_accum_vs_big_max_rel_diff") < 5e-2


def test_no_sync_all_reduces_once_per_step(executed):
    res = executed("02_gradient_accumulation")
    assert value(res, "allreduce_buckets_without_no_sync") == 4 * value(res, "allreduce_buckets_with_no_sync")


def test_bug_shows_with_sgd(executed):
    res = executed("02_gradient_accumulation")
    assert value(res, "sgd_undivided_final_loss_gap") > 0.05
    assert len(res["figures"]) >= 2


def test_a_batch_that_does_not_divide_stops_before_training(tmp_path):
    import papermill
    import pytest

    from course_lib.run_all import ROOT, execute

    nb = ROOT / "solutions" / "02_gradient_accumulation" / "02_gradient_accumulation.ipynb"
    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute(nb, tmp_path, {"tier": "smoke", "batch_size": 250, "accum_steps": 4})
    assert "batch_size=250 does not divide by accum_steps=4" in str(err.value)
    assert "multiple of 4" in str(err.value)
    # stopped in the set-up cell, before anything was trained or recorded
    import json

    assert json.loads((tmp_path / "results" / "02_gradient_accumulation.json").read_text())["values"] == {}
