"""course_lib.zero beyond what notebook 06 measures: DeepSpeed's default clipping, the config's arithmetic, and
ZeRO-1 by hand (ShardedOptimizer) against DeepSpeed's stage 1, DDP and one process.

Every ZeRO stage and offload against DDP, the sharded optimizer state and the checkpoint resume run in
notebook 06 on DeepSpeed's real engine over 2 gloo ranks, and are tested in test_notebook_06.py.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import rel_diff
from course_lib.data import synthetic_images
from course_lib.grading import max_rel_diff, params
from course_lib.launch import launch, run_forked
from course_lib.models import SmallCNN
from course_lib.zero import ShardedOptimizer, check_batch_arithmetic, ds_config, micro_batch_for


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


def test_zero1_by_hand_trains_like_deepspeed_stage_1_and_ddp_with_half_the_optimizer_state():
    ddp, ds, mine = run(engine="ddp")[0], run(stage=1)[0], run(engine="zero1")[0]
    assert rel_diff(mine["losses"], ddp["losses"]) < 1e-5
    assert rel_diff(mine["losses"], ds["losses"]) < 1e-5
    assert mine["digest"] == pytest.approx(ddp["digest"], rel=1e-6)
    # Adam's m and v for 1/2 of every (padded) parameter, plus one step counter per slice
    assert 0.5 <= mine["optimizer_state_bytes"] / ddp["optimizer_state_bytes"] < 0.5 + 0.01


def _sharded_against_one_process(rank, world_size):
    torch.manual_seed(0)
    mine, ref = SmallCNN(width=8), SmallCNN(width=8)
    ref.load_state_dict(mine.state_dict())
    mine.head.bias.requires_grad_(False)  # frozen: no slice, no state
    ref.head.bias.requires_grad_(False)
    opt = ShardedOptimizer(mine.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    x, y = synthetic_images(12 * 3, seed=1).tensors
    gaps = []
    for step in range(3):
        xg, yg = x[step * 12:(step + 1) * 12], y[step * 12:(step + 1) * 12]
        F.cross_entropy(mine(xg.chunk(world_size)[rank]), yg.chunk(world_size)[rank]).backward()
        for p in mine.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(xg), yg).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gaps.append(max_rel_diff(params(mine), params(ref)))
    owned = sum(s.numel() for s in opt.shards)
    return gaps, owned


def test_sharded_optimizer_on_three_ranks_with_uneven_sizes_and_a_frozen_parameter():
    runs = run_forked(_sharded_against_one_process, 3, timeout=120)
    total = sum(-(-p.numel() // 3) for n, p in SmallCNN(width=8).named_parameters() if n != "head.bias")
    for gaps, owned in runs:
        assert max(gaps) < 1e-6
        assert owned == total  # each rank owns ceil(n / 3) of every trainable parameter
