"""course_lib.fsdp across real processes: torchrun, 2 gloo ranks, FSDP2 on a tiny Llama."""

import pytest

from course_lib import fsdp
from course_lib.launch import launch

STEPS = 6


def rel_diff(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One torchrun launch of 2 ranks for every run (process start-up is the slow part)."""
    ckpt = str(tmp_path_factory.mktemp("dcp"))
    runs = [dict(strategy=s, steps=STEPS) for s in fsdp.STRATEGIES]
    runs += [dict(strategy="full", steps=STEPS, meta_init=True),
             dict(strategy="full", steps=STEPS, mixed_precision="bfloat16"),
             dict(strategy="full", steps=STEPS, offload=True),
             dict(strategy="full", steps=STEPS, checkpoint_dir=ckpt, stop_after=2),
             dict(strategy="full", steps=STEPS, checkpoint_dir=ckpt, resume=True)]
    out = launch("course_lib.fsdp:sweep", nprocs=2, kwargs={"runs": runs}, echo=False, timeout=240)
    return {"out": out, "ckpt": ckpt, "single": fsdp.train(strategy="single", steps=STEPS, device="cpu")}


def test_every_strategy_trains_like_one_process_on_the_global_batch(ranks):
    r0, r1 = (o["runs"] for o in ranks["out"])
    for a, b in zip(r0[:4], r1[:4]):
        assert a["losses"] == b["losses"] and a["digest"] == b["digest"], a["strategy"]
        assert len(a["losses"]) == STEPS
        assert rel_diff(a["losses"], ranks["single"]["losses"]) < 1e-5, a["strategy"]
        assert abs(a["digest"] - ranks["single"]["digest"]) / ranks["single"]["digest"] < 1e-5
    assert [r["mesh_shape"] for r in r0[:4]] == [[2], [2], [2, 1], [2, 1]]


def test_bytes_per_rank_follow_the_strategy(ranks):
    full = ranks["out"][0]["runs"][0]["full_bytes"]
    by = {r["strategy"]: r["bytes"] for r in ranks["out"][0]["runs"][:4]}
    for key in ("weights", "gradients", "optimizer states", "total"):
        assert abs(by["full"][key] / (full[key] / 2) - 1) < 0.10, key  # 1/N of the estimate
        assert by["grad_op"][key] == by["full"][key], key
        assert by["no_shard"][key] == full[key], key  # DDP: a full copy
    assert by["full"]["weights_in_backward"] == by["full"]["weights"]
    assert by["grad_op"]["weights_in_backward"] == full["weights"]  # full weights from forward to backward
    # the two ranks' shards add up to exactly one copy
    totals = [o["runs"][0]["bytes"]["total"] for o in ranks["out"]]
    assert sum(totals) == full["total"]


def test_meta_init_offload_and_mixed_precision(ranks):
    runs = ranks["out"][0]["runs"]
    full, meta, bf16, offload = runs[0], runs[4], runs[5], runs[6]
    assert meta["losses"] == full["losses"] and meta["digest"] == full["digest"]
    # cpu_ram_efficient_loading: rank 0 alone built the full weights; normally every rank does
    weights = full["full_bytes"]["weights"]
    assert [o["runs"][4]["full_weights_built"] for o in ranks["out"]] == [weights, 0]
    assert [o["runs"][0]["full_weights_built"] for o in ranks["out"]] == [weights, weights]
    assert offload["losses"] == full["losses"]
    gap = rel_diff(bf16["losses"], full["losses"])
    assert 1e-7 < gap < 1e-2  # bf16 compute: close, not equal
    assert bf16["bytes"]["weights"] == full["bytes"]["weights"]  # float32 master shards


def test_a_run_resumed_from_its_dcp_checkpoint_continues_exactly(ranks):
    from pathlib import Path

    runs = ranks["out"][0]["runs"]
    full, stopped, resumed = runs[0], runs[7], runs[8]
    assert len(stopped["losses"]) == 2 and resumed["start_step"] == 2
    assert stopped["losses"] + resumed["losses"] == full["losses"]
    assert resumed["digest"] == full["digest"]
    files = sorted(p.name for p in Path(ranks["ckpt"]).iterdir())
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2


def test_shard_size_must_divide_the_world():
    from course_lib.distributed import single_process_group

    import torch.distributed as dist

    single_process_group()
    try:
        with pytest.raises(ValueError, match="shard_size=2"):
            fsdp.make_mesh("hybrid", shard_size=2, device_type="cpu")
        with pytest.raises(ValueError, match="strategy='zero3'"):
            fsdp.make_mesh("zero3", device_type="cpu")
    finally:
        dist.destroy_process_group()  # later tests fork ranks from this process


def test_batches_are_a_function_of_the_step():
    a, b = fsdp.lm_batch(3, 4, 16, 512), fsdp.lm_batch(3, 4, 16, 512)
    assert a.equal(b) and not a.equal(fsdp.lm_batch(4, 4, 16, 512))
    assert ((a[:, 1:] - a[:, :-1]) % 512 == 7).all()
