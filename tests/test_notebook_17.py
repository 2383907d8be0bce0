"""Notebook 17 (expert parallelism) executes on the CPU tier and measures what it claims."""

import pytest

from recorded import claim, value


def test_the_students_expert_parallelism(executed):
    res = executed("17_expert_parallelism")
    assert 0 <= value(res, "ep_max_diff") < 1e-5
    dropped = value(res, "ep_dropped")
    assert dropped["none"] == 0 and dropped["1.0"] > 0  # capacity factor 1 drops some choices of an untrained router
    assert value(res, "ep_bytes_match_formula") is True
    shares = list(value(res, "drop_share_by_factor").values())
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.2 and shares[-1] == 0


def test_where_each_dimension_goes(executed):
    res = executed("17_expert_parallelism")
    sent = value(res, "bytes_per_step_8b")
    assert set(sent) == {"DP (FSDP / ZeRO-3, bf16)", "TP (Megatron pair)", "PP (stage boundary)",
                         "CP (ring, 8 x 4096 tokens)", "EP (top-2, 8 experts per layer)"}
    assert sent["PP (stage boundary)"] < sent["TP (Megatron pair)"] < sent["EP (top-2, 8 experts per layer)"]


def test_what_moes_train_with_now(executed):
    res = executed("17_expert_parallelism")
    assert 0 <= value(res, "dropless_max_diff") < 1e-5
    rows = {r["layer"]: r for r in value(res, "dropless_rows")}
    dropless = rows.pop("dropless (grouped)")
    assert dropless["of them padding"] == 0 and dropless["choices dropped"] == 0
    assert all(r["rows computed"] > dropless["rows computed"] - r["choices dropped"] for r in rows.values())
    assert rows["capacity factor 1.0"]["choices dropped"] > 0  # an untrained router overflows some experts
    late, moved = value(res, "balance_late_imbalance"), value(res, "balance_router_change")
    assert late["none"] > 1.5 and late["score bias"] < 1.5 and late["Switch loss"] < 1.5
    assert moved["score bias"] == 0 < moved["Switch loss"]
    sums = value(res, "gate_sums")
    assert sums["renormalised"] == pytest.approx(1) and sums["raw"] < 1
    for text in ("dropless experts", "a bias on the router's scores", "renormalised gates sum to 1"):
        assert claim(res, text)["held"] is True, text


def test_claims_and_figures(executed):
    res = executed("17_expert_parallelism")
    assert all(c["kind"] == "measured" and c["held"] for c in res["claims"]), res["claims"]
    assert claim(res, "an expert-parallel step's all-to-alls")["held"] is True
    assert claim(res, "expert parallelism on")["held"] is True
    assert len(res["figures"]) >= 3
