"""DeepSpeed's real engine on 2 gloo ranks: each ZeRO stage, with and without offload, against DDP."""

import pytest

from course_lib.launch import launch
from course_lib.zero import check_batch_arithmetic, ds_config

STEPS = 5


def run(**kw):
    return launch("course_lib.zero:train", nprocs=2, kwargs={"steps": STEPS, **kw}, echo=False, timeout=400)


def rel(a: dict, b: dict) -> float:
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


@pytest.fixture(scope="module")
def ddp():
    return run(engine="ddp", accum_steps=2)[0]


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_zero_stage_matches_ddp(ddp, stage, offload):
    got = run(stage=stage, accum_steps=2, offload_optimizer=offload, offload_param=offload and stage == 3)
    assert len(got[0]["losses"]) == STEPS
    assert got[0]["losses"] == got[1]["losses"]
    assert rel(got[0]["losses"], ddp["losses"]) < 1e-5
    assert abs(got[0]["digest"] - ddp["digest"]) / ddp["digest"] < 1e-5


def test_checkpoint_resume_continues_exactly(tmp_path):
    whole = run(stage=2)[0]
    first = run(stage=2, checkpoint_dir=str(tmp_path), stop_after=2)[0]
    rest = run(stage=2, checkpoint_dir=str(tmp_path), resume=True)[0]
    assert sorted(first["losses"]) == ["0", "1"] and sorted(rest["losses"]) == ["2", "3", "4"]
    assert {**first["losses"], **rest["losses"]} == pytest.approx(whole["losses"], rel=1e-6)
    assert rest["digest"] == pytest.approx(whole["digest"], rel=1e-6)


def test_deepspeed_clips_at_one_unless_told_so_and_the_config_says_it():
    # the same run without the explicit clip on the DDP side differs from step 2 on: DeepSpeed clipped
    unclipped_ddp = run(engine="ddp", clip_norm=0.0)[0]
    ds = run(stage=0, clip_norm=1.0)[0]
    assert rel(ds["losses"], unclipped_ddp["losses"]) > 1e-3
    assert ds_config(micro_batch=1, accum_steps=1, world_size=1, stage=0)["gradient_clipping"] == 1.0


def test_config_multiplies_out_and_refuses_what_deepspeed_would():
    cfg = ds_config(micro_batch=4, accum_steps=8, world_size=8, stage=3, offload_optimizer=True, offload_param=True)
    assert cfg["train_batch_size"] == 256
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    with pytest.raises(ValueError, match=r"train_batch_size=256 but micro_batch 4 x accum_steps 4 x world_size 8 = 128"):
        check_batch_arithmetic(256, 4, 4, 8)
    with pytest.raises(ValueError, match="offload_param=True needs stage=3"):
        ds_config(micro_batch=4, accum_steps=1, world_size=2, stage=2, offload_param=True)
    with pytest.raises(ValueError, match="stage=4"):
        ds_config(micro_batch=4, accum_steps=1, world_size=2, stage=4)
