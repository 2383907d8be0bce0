"""Notebook 16 (context parallelism) executes on the CPU tier and measures what it claims."""

import pytest

from recorded import claim, value


def test_the_students_ring_equals_full_attention(executed):
    res = executed("16_context_parallelism")
    assert value(res, "ring_worlds") == [2, 3, 4]
    # the student's ring_forward (either split) as ring_attention's forward
    assert 0 <= value(res, "ring_max_output_diff") < 1e-5
    assert 0 <= value(res, "ring_max_grad_diff") < 1e-5
    assert value(res, "ring_bytes_match_formula") is True
    assert claim(res, "ring attention equals attention over the whole sequence")["held"] is True
    # the tiny Llama trained 3 steps on a zig-zag ring of 4 whose forward is the student's ring_forward
    assert 0 <= value(res, "ring_llama_loss_gap") < 1e-5
    assert claim(res, "the course's Llama trains with ring attention")["held"] is True


def test_causal_imbalance_and_zigzag(executed):
    res = executed("16_context_parallelism")
    assert value(res, "causal_work_plain") == [1, 2, 3, 4]  # the last rank does N times the first's work
    assert value(res, "causal_work_zigzag") == pytest.approx([2.25] * 4)  # (2N+1)/4 blocks each
    timed = value(res, "causal_time_imbalance")  # measured, so a claim of the notebook's, not an assertion here
    assert set(timed) == {"plain", "zigzag"} and all(v > 0 for v in timed.values()), timed


def test_memory_per_rank_falls_as_one_over_n(executed):
    res = executed("16_context_parallelism")
    memory = value(res, "ring_memory_bytes")
    assert memory["1"] == 2 * memory["2"] == 4 * memory["4"] > 0
    longest = value(res, "longest_sequence_8b")
    for gpu in longest.values():
        assert gpu["ring of 8"] == 8 * gpu["ring of 1"] > 0
    assert longest["192 GB (MI300X)"]["ring of 1"] > longest["80 GB (H100)"]["ring of 1"]


def test_the_all_gather_design_gives_the_rings_output_for_the_same_bytes(executed):
    res = executed("16_context_parallelism")
    designs = value(res, "cp_designs")
    assert designs["gap"] < 1e-5 and designs["ring_bytes"] > 0
    assert designs["allgather_bytes"] == pytest.approx(designs["ring_bytes"])
    assert claim(res, "the all-gather design of context parallelism")["held"]


def test_with_grouped_query_attention_both_designs_send_and_build_a_quarter(executed):
    res = executed("16_context_parallelism")
    designs = value(res, "cp_designs")
    kv, q_heads, world = designs["kv_heads"], designs["q_heads"], designs["world"]
    assert kv["MHA"] == q_heads == 4 * kv["GQA"], kv
    by = designs["by_heads"]
    for design in ("ring", "all-gather"):
        assert by["MHA"][design]["sent"] == by["GQA"][design]["sent"] * 4 > 0  # the formula with the K/V heads
        assert by["MHA"][design]["kv_bytes"] == by["GQA"][design]["kv_bytes"] * 4 > 0
        assert all(by[h][design]["as_predicted"] and by[h][design]["ms"] > 0 for h in by), by
    for heads in by.values():  # the all-gather builds the whole sequence's K/V, the ring one block of it
        assert heads["all-gather"]["kv_bytes"] == world * heads["ring"]["kv_bytes"]
        assert heads["all-gather"]["sent"] == heads["ring"]["sent"]
    assert claim(res, "with GQA")["held"] is True


def test_claims_and_figures(executed):
    res = executed("16_context_parallelism")
    kinds = {c["claim"]: c["kind"] for c in res["claims"]}
    measured = [c for c in res["claims"] if c["kind"] == "measured"]
    assert len(measured) >= 7 and all(c["held"] for c in measured), measured
    ring = claim(res, "a ring of 8 GPUs fits 8x")
    assert ring["kind"] == "predicted" and ring["agrees"]
    torch_cp = claim(res, "torch's context_parallel")
    assert torch_cp["kind"] == "not measured here" and "GPU" in torch_cp["measured"], torch_cp
    assert claim(res, "one GPU runs out where")["kind"] == "not measured here"  # a GPU tier measures it
    assert claim(res, "a Llama's activation memory grows linearly")["held"] is True
    by_length = value(res, "llama_activation_bytes_by_length")
    assert len(by_length) == 3 and all(b > 0 for b in by_length.values())
    assert claim(res, "attention's activation memory per rank falls as 1/N")["held"] is True
    assert claim(res, "a causal ring on 4 ranks")["held"] is True
    assert len(res["figures"]) >= 1, kinds
