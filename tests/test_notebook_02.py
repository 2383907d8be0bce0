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
