"""Notebook 06's hidden tests (instructor edition only): ZeRO-1 by hand on 3 ranks (padding), with SGD and momentum
in two groups under StepLR and a frozen parameter, a checkpoint of each rank's shard resumed, the bytes a step sends
(DDP's), the state bytes on 3 ranks and DeepSpeed's stage 1 on the same batches; more configs, offload and
a batch that does not divide; OffloadedAdamW with a small learning rate, an fp32 model, a frozen and an unused layer,
and two micro-batches that add up in the masters (then a step that starts afresh)."""

from __future__ import annotations

import copy
import functools
import warnings

import torch

from course_lib import zero
from course_lib.checks import forked, number, packed, register, student, tensor_data, unpacked
from course_lib.checks.nb09 import (ADAMW, OFFLOADED, SGD, SHARDED, judge_offload, judge_sharded, judge_traffic,
                                    my_config, offload_probe, one_process, one_thread, sharded_probe, tiny_model, trains,
                                    twin_grads)
from course_lib.grading import forbid, max_rel_diff
from course_lib.launch import launch
from course_lib.zero import check_batch_arithmetic

ZERO_KW = dict(steps=2, global_batch=16, accum_steps=1, width=8, seed=0, clip_norm=0.0)  # no clipping: a contract of its own


# ---------------------------------------------------------------- ShardedOptimizer
def probe_sharded(ns: dict) -> dict:
    space = student(ns, "ShardedOptimizer")

    def yours_in_zero_train(rank, world_size):
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.set_num_threads(1)
        with forbid(*SHARDED, namespace=space):
            run = zero.train(engine="zero1", make_optimizer=lambda ps: space["ShardedOptimizer"](
                ps, torch.optim.AdamW, lr=1e-3, weight_decay=0.01), **ZERO_KW)
        return packed([number(v) for v in run["losses"]])

    return {"sgd": sharded_probe(ns, 3, 24, 3, *SGD, True, resume_at=0),
            "state": [number(run["state_bytes"]) for run in sharded_probe(ns, 3, 24, 1, *ADAMW)],
            "zero_train": unpacked(forked(yours_in_zero_train, 2)[0])}


@functools.lru_cache(maxsize=None)
def deepspeed_stage1() -> dict:
    return launch("course_lib.zero:train", 2, {**ZERO_KW, "stage": 1}, echo=False, timeout=300, device_type="cpu")[0]


def judge_sharded_hidden(got: dict) -> str:
    label = "3 ranks, SGD with momentum in two groups, StepLR, a frozen bias"
    judge_sharded(got["sgd"], label, "one process", 3, 24, 3, *SGD, True)
    judge_sharded(got["sgd"], label, "DDP with a whole optimizer", 3, 24, 3, *SGD, True)
    for r, run in enumerate(got["sgd"]):
        gap = max_rel_diff(run["resumed"], run["weights"][-1])
        assert gap < 1e-6, (f"rank {r}: a fresh model and optimizer that loaded step 1's checkpoint (state_dict of "
                            f"this rank's shard) end {gap:.1e} from the run that never stopped")
    ratio = judge_traffic(got["sgd"], 3, True)
    _, full, n_params = one_process(24, 1, ADAMW[0], tuple(sorted(ADAMW[1].items())), False)
    for held in got["state"]:
        assert abs(held / full - 1 / 3) <= 8 * 2 * n_params / full, f"a rank holds {held / full:.3f} of the state on 3 ranks"
    ds = deepspeed_stage1()
    assert max(abs(a - b) / b for a, b in zip(got["zero_train"], ds["losses"])) < 1e-5, "not DeepSpeed stage 1's losses"
    return (f"3 ranks with SGD, groups, StepLR and a frozen bias, resumed from a checkpoint, {ratio:.3f}x DDP's bytes, "
            "the bytes on 3 ranks, and DeepSpeed stage 1's losses")


register("test_ShardedOptimizer_hidden", probe_sharded, judge_sharded_hidden)


# ---------------------------------------------------------------- make_ds_config
def probe_configs(ns: dict) -> dict:
    splits = [[g, m, w, my_config(ns, g, m, w, stage=1)] for g, m, w in ((64, 8, 8), (256, 4, 8), (6, 3, 2))]
    offload = my_config(ns, 16, 4, 2, stage=3, offload_optimizer=True)
    try:
        my_config(ns, 30, 4, 2, stage=2)
    except ValueError as err:
        refused = {"raised": "ValueError", "message": str(err)}
    else:
        refused = None
    return {"splits": splits, "offload": offload, "refused": refused}


def judge_configs(got: dict) -> str:
    for _g, _m, w, c in got["splits"]:
        check_batch_arithmetic(c["train_batch_size"], c["train_micro_batch_size_per_gpu"],
                               c["gradient_accumulation_steps"], w)
    c = got["offload"]
    assert c["zero_optimization"]["stage"] == 3
    assert c["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert trains(c, 2)["global_steps"] == 2
    assert got["refused"] is not None, "30 is not a multiple of 4 x 2: expected ValueError"
    assert "global_batch" in got["refused"]["message"]
    return "other splits, offload, and a batch that does not divide"


register("test_make_ds_config_hidden", probe_configs, judge_configs)


# ---------------------------------------------------------------- OffloadedAdamW
@one_thread
def accumulation_probe(ns: dict) -> list:
    """A step of two micro-batches, then a step of one (``step`` alone in between, no ``zero_grad``): per step, what
    landed in the masters and the gradients a twin without hooks summed over the same micro-batches."""
    model = tiny_model(torch.float32, False, ns["device"])
    twin = copy.deepcopy(model)
    with forbid(*OFFLOADED, namespace=ns):
        opt = ns["OffloadedAdamW"](model.parameters(), lr=1e-3, weight_decay=0.01, offload_device="cpu")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).to(ns["device"])
    steps = []
    for micro in (2, 1):
        twin.load_state_dict(model.state_dict())
        want = None
        with forbid(*OFFLOADED, namespace=ns):
            for part in x.chunk(micro):
                loss = lambda m, part=part: m(part).pow(2).mean()  # noqa: E731
                got = twin_grads(twin, loss)
                want = got if want is None else [a + b for a, b in zip(want, got)]
                loss(model).backward()
            steps.append({"want": want, "landed": [tensor_data(getattr(m, "grad", None), torch.float32) for m in opt.master]})
            opt.step()
    return steps


def judge_accumulation(steps: list) -> None:
    why = ("two micro-batches of one step must add up in the master's .grad",
           "a step after step() must start from no gradient: set each master's .grad to None in step()")
    for (step, reason) in zip(steps, why):
        for i, (g, w) in enumerate(zip(step["landed"], step["want"])):
            assert isinstance(g, torch.Tensor) and g.shape == w.shape, f"master {i}: .grad is {g!r:.80}; {reason}"
            gap = ((g - w).abs().max() / w.abs().max().clamp(min=1e-12)).item()
            assert gap < 1e-5, f"master {i}: .grad is {gap:.1e} (relative) from the summed gradients: {reason}"


def probe_offload(ns: dict) -> dict:
    return {"small_lr": offload_probe(ns, "bfloat16", 1e-4, 30), "fp32": offload_probe(ns, "float32", 1e-3, 3),
            "frozen": offload_probe(ns, "bfloat16", 1e-3, 3, frozen=True, unused=True),
            "accumulation": accumulation_probe(ns)}


def judge_offload_hidden(got: dict) -> str:
    start = judge_offload(got["small_lr"], "bfloat16", 1e-4, 30)
    moved = sum((p != s).float().mean().item() for p, s in zip(got["small_lr"]["model"], start)) / len(start)
    assert moved > 0.9, f"only {moved:.0%} of the bf16 weights moved with lr 1e-4: the small updates were lost"
    judge_offload(got["fp32"], "float32", 1e-3, 3)
    start = judge_offload(got["frozen"], "bfloat16", 1e-3, 3, frozen=True)
    model = got["frozen"]["model"]
    assert torch.equal(model[1], start[1]), "the frozen bias changed"
    assert all(torch.equal(p, s) for p, s in zip(model[-2:], start[-2:])), \
        "a layer that got no gradient changed: give its master .grad = None"
    judge_accumulation(got["accumulation"])
    return "a small learning rate, an fp32 model, a frozen bias, a layer without a gradient, two micro-batches"


register("test_OffloadedAdamW_hidden", probe_offload, judge_offload_hidden)
