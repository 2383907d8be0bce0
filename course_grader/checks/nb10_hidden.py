"""Notebook 10's hidden tests (instructor edition only): OffloadedAdamW with a small learning rate, an fp32 model, a
frozen and an unused layer, and two micro-batches that add up in the masters (then a step that starts afresh, and
one after a backward that ``zero_grad`` discards)."""

from __future__ import annotations

import copy

import torch

from course_grader.checks import case_seed, register
from course_grader.checks.nb10 import (OFFLOADED, adamw_replay, judge_offload, landed_grads, offload_probe, one_thread,
                                   tiny_model, twin_grads)
from course_grader.grading import forbid


def seeds(name: str) -> dict:
    """A case's weights' and input's seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb10", name, "weights"), "data_seed": case_seed("nb10", name, "data")}


@one_thread
def accumulation_probe(ns: dict) -> list:
    """A step of two micro-batches, then a step of one (``step`` alone in between, no ``zero_grad``), then a backward
    that ``zero_grad`` discards and a step of one: per step, what landed in the masters and the gradients a twin
    without hooks summed over the same micro-batches."""
    case = seeds("accumulation")
    model = tiny_model(torch.float32, False, ns["device"], case["seed"])
    twin = copy.deepcopy(model)
    with forbid(*OFFLOADED, namespace=ns):
        opt = ns["OffloadedAdamW"](model.parameters(), lr=1e-3, weight_decay=0.01, offload_device="cpu")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(case["data_seed"])).to(ns["device"])
    steps = []
    for micro, discarded in ((2, False), (1, False), (1, True)):
        twin.load_state_dict(model.state_dict())
        want = None
        with forbid(*OFFLOADED, namespace=ns):
            if discarded:  # a backward whose gradients are thrown away (a skipped step): none may reach the next
                model(-x).pow(3).mean().backward()
                opt.zero_grad(set_to_none=True)
            for part in x.chunk(micro):
                loss = lambda m, part=part: m(part).pow(2).mean()  # noqa: E731
                got = twin_grads(twin, loss)
                want = got if want is None else [a + b for a, b in zip(want, got)]
                loss(model).backward()
            steps.append({"want": want, "landed": landed_grads(opt, ns["device"])})
            opt.step()
    return steps


def judge_accumulation(steps: list) -> None:
    why = ("two micro-batches of one step must add up in the master's .grad",
           "a step after step() must start from no gradient: set each master's .grad to None in step()",
           "a step after zero_grad() must start from no gradient: zero_grad() sets the masters' .grad to None too")
    n = sum(1 for p in tiny_model(torch.float32, False).parameters() if p.requires_grad)
    assert len(steps) == len(why), f"{len(steps)} steps' gradients in the masters, expected {len(why)}"
    for (step, reason) in zip(steps, why):
        assert len(step["landed"]) == len(step["want"]) == n, \
            f"{len(step['landed'])} masters' gradients, the model has {n} parameters; {reason}"
        for i, (g, w) in enumerate(zip(step["landed"], step["want"])):
            assert isinstance(g, torch.Tensor) and g.shape == w.shape, f"master {i}: .grad is {g!r:.80}; {reason}"
            gap = ((g - w).abs().max() / w.abs().max().clamp(min=1e-12)).item()
            assert gap < 1e-5, f"master {i}: .grad is {gap:.1e} (relative) from the summed gradients: {reason}"


def probe_offload(ns: dict) -> dict:
    return {"small_lr": offload_probe(ns, "bfloat16", 1e-4, 30, **seeds("small lr")),
            "fp32": offload_probe(ns, "float32", 1e-3, 3, **seeds("fp32")),
            "frozen": offload_probe(ns, "bfloat16", 1e-3, 3, frozen=True, unused=True, **seeds("frozen")),
            "accumulation": accumulation_probe(ns)}


def judge_offload_hidden(got: dict) -> str:
    start = judge_offload(got["small_lr"], "bfloat16", 1e-4, 30, seed=seeds("small lr")["seed"])
    moved = sum((p != s).float().mean().item() for p, s in zip(got["small_lr"]["model"], start)) / len(start)
    # the share fp32 AdamW's rounding moves depends on the weights (0.8 to 1 of them); bf16 steps move about 0.2. The
    # gradients replayed are the run's own, so the floor stands apart from them: gradients that move nothing pass no
    # run that lost its small updates
    fp32 = adamw_replay(got["small_lr"]["grads"], start, 1e-4)
    want = sum((r.to(s.dtype) != s).float().mean().item() for r, s in zip(fp32, start)) / len(start)
    assert moved > max(want - 0.05, 0.7), (f"only {moved:.0%} of the bf16 weights moved with lr 1e-4, where fp32 "
                                           f"AdamW on the same gradients moves {want:.0%}: the small updates were lost")
    judge_offload(got["fp32"], "float32", 1e-3, 3, seed=seeds("fp32")["seed"])
    start = judge_offload(got["frozen"], "bfloat16", 1e-3, 3, frozen=True, unused=True, seed=seeds("frozen")["seed"])
    model = got["frozen"]["model"]
    assert torch.equal(model[1], start[1]), "the frozen bias changed"
    assert all(torch.equal(p, s) for p, s in zip(model[-2:], start[-2:])), \
        "a layer that got no gradient changed: give its master .grad = None"
    judge_accumulation(got["accumulation"])
    return ("a small learning rate, an fp32 model, a frozen bias, a layer without a gradient, two micro-batches, "
            "a discarded backward")


register("test_OffloadedAdamW_hidden", probe_offload, judge_offload_hidden)
