"""course_lib.zero beyond what notebook 06 measures: DeepSpeed's default clipping, and the config's arithmetic.

Every ZeRO stage and offload against DDP, the sharded optimizer state and the checkpoint resume run in
notebook 06 on DeepSpeed's real engine over 2 gloo ranks, and are tested in test_notebook_06.py.
"""

import pytest

from conftest import rel_diff
from course_lib.launch import launch
from course_lib.zero import check_batch_arithmetic, ds_config, micro_batch_for


def run(**kw):
    return launch("course_lib.zero:train", nprocs=2, kwargs={"steps": 5, **kw}, echo=False, timeout=400)


def test_deepspeed_clips_at_one_unless_told_so_and_the_config_says_it():
    # the same run without the explicit clip on the DDP side differs from step 2 on: DeepSpeed clipped
    unclipped_ddp = run(engine="ddp", clip_norm=0.0)[0]
    clipped_ddp = run(engine="ddp", clip_norm=1.0)[0]
    ds = run(stage=0, clip_norm=1.0)[0]
    assert rel_diff(ds["losses"], unclipped_ddp["losses"]) > 1e-3
    assert rel_diff(ds["losses"], clipped_ddp["losses"]) < 1e-5
    assert ds["start_step"] == 0 and ds["world_size"] == 2 and len(ds["losses"]) == 5
    assert ds_config(train_batch=1, accum_steps=1, world_size=1, stage=0)["gradient_clipping"] == 1.0


def test_config_is_derived_from_the_global_batch_and_refuses_what_deepspeed_would():
    cfg = ds_config(train_batch=256, accum_steps=8, world_size=8, stage=3, offload_optimizer=True, offload_param=True)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (256, 4, 8)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    check_batch_arithmetic(cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
                           cfg["gradient_accumulation_steps"], 8)
    with pytest.raises(ValueError, match=r"train_batch=100 does not divide by accum_steps 4 x world_size 8 = 32: "
                                         r"use a multiple of 32 \(e.g. 96\)"):
        ds_config(train_batch=100, accum_steps=4, world_size=8, stage=2)
    assert micro_batch_for(96, 4, 8) == 3
    with pytest.raises(ValueError, match=r"train_batch_size=256 but micro_batch 4 x accum_steps 4 x world_size 8 = 128"):
        check_batch_arithmetic(256, 4, 4, 8)
    with pytest.raises(ValueError, match="offload_param=True needs stage=3"):
        ds_config(train_batch=8, accum_steps=1, world_size=2, stage=2, offload_param=True)
    with pytest.raises(ValueError, match="stage=4"):
        ds_config(train_batch=8, accum_steps=1, world_size=2, stage=4)


def test_checkpoints_are_deepspeeds_only():
    with pytest.raises(Exception, match="engine='deepspeed'"):
        run(engine="ddp", stop_after=2, checkpoint_dir="/tmp/unused")
