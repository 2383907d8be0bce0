"""course_lib.parallel.ddp, ddp_torch and ddp_cost on real gloo ranks: the hand-written bucketed DDP against torch's,
the collective log, the one worker's modes, and the step-time model."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_grader.grading import grads, max_rel_diff
from course_lib.data import synthetic_images
from course_lib.distributed import CollectiveLog
from course_lib.launch import run_forked
from course_lib.models import SmallCNN
from course_lib.parallel import ddp, ddp_cost, ddp_torch
from course_lib.parallel.ddp_torch import DDPRun
from course_lib.train import Dims


def test_buckets_fill_from_the_last_parameter_and_close_once_they_reach_the_cap():
    net = nn.Sequential(nn.Linear(4, 256), nn.Linear(256, 4))  # 4 KiB, 1 KiB, 4 KiB, 16 B of float32
    w0, b0, w1, b1 = net.parameters()
    names = lambda buckets: [[id(p) for p in b] for b in buckets]  # noqa: E731
    # 4.5 KiB: b1 and w1 (4112 B) are under it, b0 takes the bucket past it and closes it
    assert names(ddp.bucket_parameters(net.parameters(), 4.5 / 1024)) == names([[b1, w1, b0], [w0]])
    assert names(ddp.bucket_parameters(net.parameters(), 1.0)) == names([[b1, w1, b0, w0]])
    # 1 KiB: w1 closes the first bucket, b0 reaches the cap exactly and closes its own
    assert names(ddp.bucket_parameters(net.parameters(), 1 / 1024)) == names([[b1, w1], [b0], [w0]])
    assert names(ddp.bucket_parameters(net.parameters(), 0.0)) == names([[b1], [w1], [b0], [w0]])
    b0.requires_grad_(False)
    assert names(ddp.bucket_parameters(net.parameters(), 1.0)) == names([[b1, w1, w0]])  # frozen: left out


@pytest.mark.parametrize("cap_bytes", [0, 400, 1000, 1024, 4096, 5000, 10**6])
def test_buckets_are_torch_reducers_over_the_order_gradients_arrive(cap_bytes):
    """torch's own assignment (what DDP's reducer computes, here over the parameters in reverse) is ours."""
    net = nn.Sequential(nn.Linear(4, 256), nn.Linear(256, 4), nn.Linear(4, 25), nn.Linear(25, 100))
    params = list(reversed(list(net.parameters())))
    theirs, _ = dist._compute_bucket_assignment_by_size(params, [cap_bytes])
    ours = ddp.bucket_parameters(net.parameters(), cap_bytes / 2**20)
    assert [[id(p) for p in b] for b in ours] == [[id(params[i]) for i in b] for b in theirs]


def _bucketed_against_ddp(steps, cap):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different weights on every rank: wrapping must broadcast rank 0's
    mine = ddp.BucketedDDP(SmallCNN(width=8), bucket_cap_mb=cap)
    torch.manual_seed(0)
    theirs = DDP(SmallCNN(width=8))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, theirs)]
    x, y = synthetic_images(8 * world_size * steps, seed=1).tensors
    out, logs = [], []
    for p in mine.module.parameters():  # after BucketedDDP's own hooks: fires once a gradient is in
        p.register_post_accumulate_grad_hook(lambda _p: logs[-1].mark("grad"))
    for step in range(steps):
        xs, ys = [t.chunk(world_size * steps)[step * world_size + rank] for t in (x, y)]
        with CollectiveLog() as log:
            logs.append(log)
            F.cross_entropy(mine(xs), ys).backward()
            mine.finish_gradient_synchronization()
        F.cross_entropy(theirs(xs), ys).backward()
        out.append((max_rel_diff(grads(mine.module), grads(theirs.module)), log.events))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"steps": out, "buckets": len(mine.buckets)}


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_ddp_gives_ddp_gradients_with_one_overlapped_all_reduce_per_bucket(world):
    runs = run_forked(_bucketed_against_ddp, world, dict(steps=3, cap=0.004), timeout=120)
    for run in runs:
        assert run["buckets"] == 4  # SmallCNN(width=8) at 0.004 MiB: one bucket per layer (bucket_parameters)
        for gap, events in run["steps"]:
            assert gap < 1e-5
            launches = [i for i, e in enumerate(events) if e["what"] == "all_reduce"]
            grads_in = [i for i, e in enumerate(events) if e["what"] == "grad"]
            assert len(launches) == run["buckets"]
            assert all(events[i]["async_op"] and events[i]["waited"] for i in launches)
            waits = [i for i, e in enumerate(events) if e["what"] == "wait"]
            assert min(waits) > launches[-1], "no bucket is waited on before the last one has left"
            assert launches[0] < grads_in[-1], "the first bucket must leave while backward still runs"


def test_a_bucket_never_waited_on_is_seen_by_the_log():
    def never_wait():
        with CollectiveLog() as log:
            t = torch.ones(3)
            dist.all_reduce(t, async_op=True)
            work = dist.all_reduce(torch.ones(2), async_op=True)
            work.wait()
            dist.all_reduce(torch.ones(1))
        dist.barrier()
        return [(e["what"], e.get("waited")) for e in log.events]

    events = run_forked(never_wait, 2, timeout=60)[0]
    assert events == [("all_reduce", False), ("all_reduce", True), ("wait", None), ("all_reduce", True)]
    assert dist.all_reduce.__name__ == "all_reduce"  # restored


@pytest.mark.parametrize("mode", ["bucketed", "manual"])
def test_train_with_accumulation_matches_ddp(mode):
    spec = DDPRun(steps=3, global_batch=16, width=8, accum_steps=2, n_samples=64)
    runs = {m: run_forked(ddp_torch.train, 2, dict(spec=DDPRun.of(spec, mode=m)), timeout=120)[0]
            for m in ("ddp", mode)}
    assert max(abs(a - b) / b for a, b in zip(runs[mode]["losses"], runs["ddp"]["losses"])) < 1e-5
    assert runs[mode]["digest"] == pytest.approx(runs["ddp"]["digest"], rel=1e-6)


def test_train_runs_a_gradient_sync_of_your_own():
    """Notebook 04 passes the student's average_gradients to ``train``: it is what runs after backward."""
    spec = DDPRun(steps=3, global_batch=16, width=8, n_samples=64)

    def summed(model):  # no division by the world size: a 2x learning rate on 2 ranks
        for p in model.parameters():
            dist.all_reduce(p.grad)

    def runs():
        return {"ddp": ddp_torch.train(spec),
                "yours": ddp_torch.train(DDPRun.of(spec, mode="yours"), sync_grads=ddp.all_reduce_gradients),
                "summed": ddp_torch.train(DDPRun.of(spec, mode="summed"), sync_grads=summed),
                "wrapped": ddp_torch.train(DDPRun.of(spec, mode="wrapped"), wrap=DDP)}

    out = run_forked(runs, 2, timeout=120)[0]
    for name in ("yours", "wrapped"):
        assert max(abs(a - b) / b for a, b in zip(out[name]["losses"], out["ddp"]["losses"])) < 1e-5, name
    assert out["summed"]["losses"][0] == pytest.approx(out["ddp"]["losses"][0])  # the same start...
    assert out["summed"]["digest"] != pytest.approx(out["ddp"]["digest"], rel=1e-4)  # ...and another training


def test_apply_ddp_over_a_mesh_trains_like_over_the_world():
    """apply_ddp(model, mesh, cfg): a 1-D mesh of every rank (Dims.mesh) is the whole world's group."""
    spec = DDPRun(steps=2, global_batch=16, width=8, n_samples=64)

    def runs():
        mesh = Dims(spec.global_batch, dp=dist.get_world_size()).mesh("cpu")
        over_mesh = ddp_torch.train(DDPRun.of(spec, mode="mesh"), wrap=lambda m: ddp_torch.apply_ddp(m, mesh, spec))
        return {"world": ddp_torch.train(spec), "mesh": over_mesh}

    out = run_forked(runs, 2, timeout=120)[0]
    assert out["mesh"]["losses"] == out["world"]["losses"] and out["mesh"]["digest"] == out["world"]["digest"]
    with pytest.raises(ValueError, match="DDPRun has no field stepz"):
        DDPRun.of({"stepz": 3})


def test_a_rank_whose_batch_scores_no_token_still_syncs_with_the_others():
    """Token-weighted DDP where rank 1's whole batch is masked: no hang, and the gradients of the global batch."""
    from course_lib import models, train
    from course_lib.loss import forward_loss

    torch.manual_seed(0)
    base = models.build_llama("tiny")
    ids = torch.randint(0, base.config.vocab_size, (4, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[2:] = -100  # the second half of the global batch (rank 1's rows) scores nothing
    whole = copy.deepcopy(base)
    forward_loss(whole, {"input_ids": ids, "labels": labels}).backward()
    want = {n: p.grad.clone() for n, p in whole.named_parameters()}

    def step():
        rank = dist.get_rank()
        model = DDP(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        seen = {}
        opt.register_step_pre_hook(lambda *a: seen.update({n.removeprefix("module."): p.grad.clone()
                                                            for n, p in model.named_parameters()}))
        rows = slice(2 * rank, 2 * rank + 2)
        train.train_step(model, opt, {"input_ids": ids[rows], "labels": labels[rows]}, accum_steps=2,
                         token_weighted=True)
        # plain numbers back: tensors would travel as shared memory that dies with the rank
        return (all(bool(torch.isfinite(g).all()) for g in seen.values()),
                max((seen[n] - want[n]).abs().max().item() for n in want))

    for finite, diff in run_forked(step, 2, timeout=60):
        assert finite and diff < 1e-5


def test_throughput_times_every_data_parallel_mode_and_refuses_unknown_ones():
    def modes():
        out = {m: ddp_torch.throughput(global_batch=8, width=8, steps=1, mode=m)["samples_per_s"]
               for m in ("ddp", "bucketed", "manual")}
        out["own"] = ddp_torch.throughput(global_batch=8, width=8, steps=1, mode="own", wrap=copy.deepcopy,
                                          sync_grads=ddp.all_reduce_gradients)["samples_per_s"]
        with pytest.raises(ValueError, match="use 'ddp', 'bucketed', 'manual' or 'dp'"):
            ddp_torch.throughput(global_batch=8, mode="zero")
        with pytest.raises(ValueError, match="multiple of 2"):
            ddp_torch.throughput(global_batch=7)
        return out

    assert all(v > 0 for v in run_forked(modes, 2, timeout=120)[0].values())


class _Detour(nn.Module):
    """SmallCNN(width=8) and a layer ``spare`` that the forward uses only while ``use_spare`` is set."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.spare, self.use_spare = SmallCNN(width=8), nn.Linear(10, 10), True

    def forward(self, x):
        out = self.body(x)
        return self.spare(out) if self.use_spare else out


def _skip_a_layer_then_use_it(cap):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mine = ddp.BucketedDDP(_Detour(), bucket_cap_mb=cap)
    x, y = synthetic_images(8, seed=1).tensors
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    mine.module.use_spare = False
    F.cross_entropy(mine(xs), ys).backward()
    try:
        mine.finish_gradient_synchronization()
        error = None
    except RuntimeError as err:
        error = str(err)
    with mine.no_sync():  # a skipped layer under no_sync is no error: nothing is counted there
        F.cross_entropy(mine(xs), ys).backward()
    mine.zero_grad()
    mine.module.use_spare = True  # the same wrapper, a step that uses every parameter: it must have reset
    F.cross_entropy(mine(xs), ys).backward()
    mine.finish_gradient_synchronization()
    one = _Detour()
    F.cross_entropy(one(x), y).backward()
    return {"error": error, "buckets": len(mine.buckets), "gap": max_rel_diff(grads(mine.module), grads(one))}


@pytest.mark.parametrize("cap", [100.0, 0.001])
def test_bucketed_ddp_names_a_parameter_the_forward_skipped_and_recovers(cap):
    """torch's DDP raises where a parameter gets no gradient; silence would leave its bucket unreduced."""
    for run in run_forked(_skip_a_layer_then_use_it, 2, dict(cap=cap), timeout=120):
        assert run["buckets"] == (1 if cap > 1 else 4)  # one, or several: those without spare left before the error
        assert run["error"] is not None, "a bucket that never filled must raise, not diverge silently"
        assert "spare.weight" in run["error"] and "spare.bias" in run["error"], run["error"]
        assert "body." not in run["error"], "only the parameters without a gradient are named"
        assert "requires_grad=False" in run["error"] and "find_unused_parameters=True" in run["error"]
        assert run["gap"] < 1e-5  # the next step is a normal one: one process's gradients on the whole batch


def _steps(fixed: float, per_sample: float, sync: float, n: int):
    """Step times of a machine that follows the model exactly: one rank at 256 and 1024 samples, n at 1024."""
    return [(256, fixed + per_sample * 256), (1024, fixed + per_sample * 1024)], (1024, fixed + per_sample * 1024 / n
                                                                                   + sync)


def test_the_step_time_model_recovers_a_machine_and_sizes_the_batch_where_n_ranks_reach_the_share():
    """A step is a fixed part every rank pays, a part per sample that N ranks split, and the exposed sync. On an
    H100-like node (1 ms fixed, 0.2 us per sample, 0.3 ms of sync, 8 ranks) the node tier's old throughput batch
    (2048 samples) predicts under 2x, far from 0.7 x 8; the batch the model picks reaches 5.6x, and one fewer multiple
    of 8 does not."""
    one, many = _steps(1e-3, 2e-7, 3e-4, 8)
    model = ddp_cost.step_time_model(one, 8, many)
    assert model["fixed_s"] == pytest.approx(1e-3) and model["per_sample_s"] == pytest.approx(2e-7)
    assert model["sync_s"] == pytest.approx(3e-4)
    assert ddp_cost.predicted_speedup(model, 2048) < 2
    batch = ddp_cost.batch_for_speedup(model, 0.7)
    assert batch % 8 == 0
    assert ddp_cost.predicted_speedup(model, batch) >= 0.7 * 8 > ddp_cost.predicted_speedup(model, batch - 8)
    two = ddp_cost.step_time_model(*_steps(1e-3, 2e-7, 0.0, 2)[:1], 2, (64, 1e-3))
    assert ddp_cost.batch_for_speedup(two, 0.5) == 2


def test_the_step_time_model_refuses_timings_it_cannot_fit():
    with pytest.raises(ValueError, match="two or more different batches"):
        ddp_cost.step_time_model([(64, 0.01), (64, 0.02)], 2, (64, 0.01))
    with pytest.raises(ValueError, match="not slower, so the timings are noise"):
        ddp_cost.step_time_model([(64, 0.02), (256, 0.01)], 2, (256, 0.01))
    with pytest.raises(ValueError, match="share below 1"):
        ddp_cost.batch_for_speedup({"fixed_s": 1e-3, "per_sample_s": 1e-6, "sync_s": 0.0, "n_ranks": 2}, 1.0)


def test_size_throughput_times_this_machine_and_returns_a_batch_its_own_model_backs():
    """On 2 CPU ranks over gloo: one rank grows its batch until compute shows, the line through the last two runs, 2
    ranks on the last batch; the batch returned divides over the ranks and its predicted speedup reaches the share."""
    got = ddp_torch.size_throughput("cpu", 2, width=8, steps=2, smallest=16, share=0.6)
    assert [r["ranks"] for r in got["runs"]][-1] == 2 and len(got["runs"]) >= 3
    assert [r["global_batch"] for r in got["runs"] if r["ranks"] == 1][:2] == [16, 64]
    assert got["per_sample_s"] > 0 and got["global_batch"] % 2 == 0 and got["global_batch"] == got["wanted"]
    assert got["predicted_speedup"] >= 0.6 * 2
