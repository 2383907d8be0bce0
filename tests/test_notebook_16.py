"""Notebook 16 (expert parallelism) executes on the CPU tier and measures what it claims."""

from recorded import claim, value


def test_the_students_expert_parallelism(executed):
    res = executed("16_expert_parallelism")
    assert 0 <= value(res, "ep_max_diff") < 1e-5
    dropped = value(res, "ep_dropped")
    assert dropped["none"] == 0 and dropped["1.0"] > 0  # capacity factor 1 drops some choices of an untrained router
    assert value(res, "ep_bytes_match_formula") is True
    shares = list(value(res, "drop_share_by_factor").values())
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.2 and shares[-1] == 0


def test_where_each_dimension_goes(executed):
    res = executed("16_expert_parallelism")
    sent = value(res, "bytes_per_step_8b")
    assert set(sent) == {"DP (FSDP / ZeRO-3, bf16)", "TP (Megatron pair)", "PP (stage boundary)",
                         "CP (ring, 8 x 4096 tokens)", "EP (top-2, 8 experts per layer)"}
    assert sent["PP (stage boundary)"] < sent["TP (Megatron pair)"] < sent["EP (top-2, 8 experts per layer)"]


def test_claims_and_figures(executed):
    res = executed("16_expert_parallelism")
    assert all(c["kind"] == "measured" and c["held"] for c in res["claims"]), res["claims"]
    assert claim(res, "an expert-parallel step's all-to-alls")["held"] is True
    assert claim(res, "expert parallelism on")["held"] is True
    assert len(res["figures"]) >= 2
