"""course_lib.parallel.zero, zero_deepspeed, offload and offload_cost beyond what notebooks 09 and 10 measure:
DeepSpeed's default clipping, the config's arithmetic, ZeRO-1 by hand (ShardedOptimizer: groups, a scheduler, a
resumed checkpoint, DDP's bytes) against DeepSpeed's stage 1, DDP and one process, and offload's accounting,
its CPU Adam and its optimizer by hand (the size sweep is test_size_sweep.py's).

Every ZeRO stage against DDP, the sharded optimizer state and the checkpoint resume run in notebook 09, offload
against DDP in notebook 10, on DeepSpeed's real engine over 2 gloo ranks: test_notebook_09.py and
test_notebook_10.py test them.
"""


import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recorded import rel_diff
from course_grader.grading import max_rel_diff, params
from course_lib import memory
from course_lib.data import synthetic_images
from course_lib.distributed import CollectiveBytes
from course_lib.launch import on_ranks, run_forked
from course_lib.models import SmallCNN
from course_lib.parallel import offload, offload_cost, zero, zero_deepspeed
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.parallel.zero_deepspeed import ZeroRun, check_batch_arithmetic, ds_config


def run(**kw):
    return on_ranks(zero_deepspeed.train, 2, "cpu", timeout=400, spec=ZeroRun(**{"steps": 5, **kw}))


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
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (256, 4, 8)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    check_batch_arithmetic(cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"],
                           cfg["gradient_accumulation_steps"], 8)
    with pytest.raises(ValueError, match=r"global_batch=100 does not divide by accum_steps 4 x dp 8 = 32 .*"
                                         r"use a multiple of 32 \(e.g. 96\)"):  # train.Dims: the one check
        ds_config(train_batch=100, accum_steps=4, world_size=8, stage=2)
    assert ds_config(train_batch=96, accum_steps=4, world_size=8, stage=2)["train_micro_batch_size_per_gpu"] == 3
    with pytest.raises(ValueError,
                       match=r"train_batch_size=256 but micro_batch 4 x accum_steps 4 x world_size 8 = 128"):
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
    # 1e-5, as the notebook gives DeepSpeed: the clipping norm sums the slices' squares in another order than torch's,
    # and Adam turns a last-bit change of a gradient that is rounding noise (a conv bias before GroupNorm) into a step
    assert mine["digest"] == pytest.approx(ddp["digest"], rel=1e-5)
    # Adam's m and v for 1/2 of every (padded) parameter, plus one step counter per slice
    assert 0.5 <= mine["optimizer_state_bytes"] / ddp["optimizer_state_bytes"] < 0.5 + 0.01


def _sgd(params, sharded: bool):
    kw = dict(lr=0.1, momentum=0.9)
    return ShardedOptimizer(params, torch.optim.SGD, **kw) if sharded else torch.optim.SGD(params, **kw)


def _grouped(model, sharded: bool):
    """SGD with momentum in two groups (the head's added later, at its own lr; its frozen bias left out), halved by
    StepLR at every step."""
    feats = list(model.features.parameters())
    opt = _sgd(feats, sharded)
    opt.add_param_group({"params": [p for p in model.head.parameters() if sharded or p.requires_grad], "lr": 0.05})
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _cnn(state=None):
    torch.manual_seed(0)
    model = SmallCNN(width=8)
    if state is not None:
        model.load_state_dict(state)
    model.head.bias.requires_grad_(False)  # frozen: no slice, no state
    return model


def _sharded_on_ranks():
    """ShardedOptimizer (no DDP) against SGD in one process on the whole batch: groups, a scheduler, a closure, the
    bytes it sends, and a checkpoint of this rank's shard resumed by a fresh model and optimizer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine, ref = _cnn(), _cnn()
    (opt, sched), (ref_opt, ref_sched) = _grouped(mine, True), _grouped(ref, False)
    x, y = synthetic_images(12 * 4, seed=1).tensors
    batch = lambda s: (x[s * 12:(s + 1) * 12], y[s * 12:(s + 1) * 12])  # noqa: E731
    local = lambda model, s: F.cross_entropy(model(batch(s)[0].chunk(world_size)[rank]),  # noqa: E731
                                             batch(s)[1].chunk(world_size)[rank])
    gaps, saved = [], None
    for step in range(4):
        with CollectiveBytes() as sent:
            loss = opt.step(lambda: (local(mine, step).backward(), 0.5)[1])  # the closure's value comes back
        opt.zero_grad()
        sched.step()
        F.cross_entropy(ref(batch(step)[0]), batch(step)[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        gaps.append(max_rel_diff(params(mine), params(ref)))
        if step == 1:  # a checkpoint: the model (every rank has it whole) and this rank's shard
            saved = copy.deepcopy((mine.state_dict(), opt.state_dict(), sched.state_dict()))
    again = _cnn(saved[0])
    opt2, sched2 = _grouped(again, True)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    for step in (2, 3):
        local(again, step).backward()
        opt2.step()
        opt2.zero_grad()
        sched2.step()
    wrong = {**saved[1], "rank": (rank + 1) % world_size}
    with pytest.raises(ValueError, match="load each rank's own file"):
        opt2.load_state_dict(wrong)
    return {"gaps": gaps, "loss": loss, "owned": [s.numel() for s in opt.shards], "calls": sent.calls_by_kind,
            "sent": sent.sent_bytes_by_kind, "lrs": [g["lr"] for g in opt.param_groups],
            "inner_lrs": [g["lr"] for g in opt.optimizer.param_groups],
            "resumed": all(torch.equal(a, b) for a, b in zip(again.parameters(), mine.parameters()))}


def test_sharded_optimizer_reduce_scatters_steps_its_slice_and_resumes_on_three_ranks():
    runs = run_forked(_sharded_on_ranks, 3, timeout=120)
    model = _cnn()
    groups = [sum(p.numel() for p in model.features.parameters()), model.head.weight.numel()]  # 6144, 5120
    assert [-(-n // 3) for n in groups] == runs[0]["owned"]  # each group padded to a multiple of 3, one slice each
    for r in runs:
        assert max(r["gaps"]) < 1e-6, r["gaps"]  # the average of the ranks' gradients: one process's step
        assert r["loss"] == 0.5 and r["resumed"]
        assert r["lrs"] == [0.1 * 0.5 ** 4, 0.05 * 0.5 ** 4]  # StepLR halved each group's lr 4 times,
        assert r["inner_lrs"] == [0.1 * 0.5 ** 3, 0.05 * 0.5 ** 3]  # and the 4th step stepped with 3 halvings
        # one reduce-scatter and one all-gather per group, no all-reduce: (N-1)/N of the padded flat buffer each,
        # together 2 (N-1)/N x 4 bytes per parameter, DDP's all-reduce
        assert r["calls"] == {"reduce_scatter": 2, "all_gather": 2}
        padded = 3 * sum(r["owned"])
        assert r["sent"] == {"reduce_scatter": 2 * padded * 4 // 3, "all_gather": 2 * padded * 4 // 3}


def test_sharded_optimizer_in_one_process_is_its_inner_optimizer_and_refuses_mixed_dtypes():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    mine, ref = ShardedOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert mine.param_groups[0]["betas"] == (0.9, 0.999)  # the inner optimizer's defaults, shown
    x = torch.randn(4, 5)
    for model, opt in ((a, mine), (b, ref)):
        for _ in range(3):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.allclose(p, q, atol=1e-7) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="different dtypes"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))],
                         torch.optim.SGD, lr=0.1)


def test_zero1_sends_what_ddp_sends():
    ddp, mine = (run_forked(zero.step_traffic, 2, dict(engine=engine), timeout=60)[0] for engine in ("ddp", "zero1"))
    assert ddp["calls"] == {"all_reduce": 1} and mine["calls"] == {"reduce_scatter": 1, "all_gather": 1}
    assert ddp["sent_bytes_per_param"] == mine["sent_bytes_per_param"] == 2 * (2 - 1) / 2 * 4


def test_offload_plan_and_link_bytes_follow_the_zero_offload_accounting():
    per = {s: {r["state"]: (r["lives on"], r["bytes per parameter"]) for r in offload_cost.offload_plan(s, 1)}
           for s in offload_cost.OFFLOAD_STRATEGIES}
    on = lambda s, where: sum(b for w, b in per[s].values() if w == where)  # noqa: E731
    assert on("pytorch", "GPU") == 16 and on("zero2_offload", "GPU") == 2 and on("zero3_offload", "GPU") == 0
    assert on("zero2_offload", "CPU") == 16 and on("zero3_offload", "CPU") == 18 and on("zero3_nvme", "NVMe") == 18
    sharded = {r["state"]: r["bytes on this rank"]
               for r in offload_cost.offload_plan("zero2_offload", 1000, world_size=4, low_bytes=4)}
    assert sharded == {"16-bit weights": 4000, "fp32 gradients": 1000, "fp32 master weights": 1000,
                       "Adam m and v": 2000}
    assert offload_cost.link_bytes_per_step("zero2_offload", 10) == {"host to GPU": 20, "GPU to host": 40,
                                                                     "NVMe read": 0, "NVMe write": 0}
    assert sum(offload_cost.link_bytes_per_step("zero3_offload", 1).values()) == 8
    hide = offload_cost.tokens_to_hide(6, 25e9, 1e9, 60e12)
    assert hide == pytest.approx({"link": 2400.0, "CPU optimizer": 10000.0})
    with pytest.raises(ValueError, match="strategy='zero4'"):
        offload_cost.offload_plan("zero4", 1)
    with pytest.raises(ValueError, match="cpu_adam=True needs offload_optimizer=True"):
        ds_config(train_batch=2, accum_steps=1, world_size=1, stage=2, cpu_adam=True)
    cfg = ds_config(train_batch=2, accum_steps=1, world_size=1, stage=2, offload_optimizer=True, cpu_adam=True)
    assert cfg["optimizer"]["params"]["torch_adam"] is False and "zero_force_ds_cpu_optimizer" not in cfg


def test_cpu_adam_timing_covers_three_implementations_of_one_update():
    out = offload.time_cpu_adam(200_000, repeat=2)
    assert out["error"] is None, out["error"]
    assert set(out["seconds"]) == {"torch AdamW (foreach, default)", "torch AdamW (fused=True)", "DeepSpeed CPU Adam"}
    assert all(s > 0 for s in out["seconds"].values())
    assert max(out["max_abs_diff_vs_torch"].values()) < 1e-5
    with pytest.raises(ValueError, match="n_params=2"):
        offload.time_cpu_adam(2)


def test_offloaded_adamw_keeps_fp32_masters_off_the_model_and_bf16_weights_learning():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(torch.bfloat16)
    model[0].bias.requires_grad_(False)
    start = [p.detach().clone() for p in model.parameters()]
    opt = offload.OffloadedAdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 8).to(torch.bfloat16)
    for _ in range(30):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(opt.master) == 3 and all(m.dtype == torch.float32 for m in opt.master)
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(opt.params, opt.master))
    assert torch.equal(model[0].bias, start[1])  # frozen: no master, never touched
    moved = sum((p.detach() != s).float().mean().item() for p, s in zip(opt.params, [start[0], *start[2:]])) / 3
    assert moved > 0.9  # lr 1e-4 is below bf16's resolution near 0.1-1: only fp32 masters carry it


def test_offloaded_adamw_sends_each_gradient_down_during_backward_and_accumulates():
    """Each gradient leaves the model as soon as backward has produced it (the device holds one parameter's at a
    time, not the model's), lands in its fp32 master's .grad, and micro-batches add up there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    twin = copy.deepcopy(model)  # no hooks: the gradients a plain backward leaves
    meter, twin_meter = memory.GradientMeter(model), memory.GradientMeter(twin)
    opt = offload.OffloadedAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 8)
    for half in (x[:3], x[3:]):  # two micro-batches, one step
        model(half).pow(2).sum().backward()
        twin(half).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters()) and meter.after == 0
    for m, t in zip(opt.master, twin.parameters()):
        assert m.grad.dtype == torch.float32 and torch.allclose(m.grad, t.grad, rtol=1e-6, atol=1e-7)
    largest = max(p.numel() * 4 for p in model.parameters())
    assert meter.peak == largest  # one gradient at a time: the largest one
    assert twin_meter.peak == twin_meter.after == sum(p.numel() * 4 for p in twin.parameters())
    opt.step()
    assert all(m.grad is None for m in opt.master)  # the next step accumulates afresh
