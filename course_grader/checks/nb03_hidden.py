"""Notebook 03's hidden tests (instructor edition only): stale gradients and other splits, a micro-batch that scores
nothing, and micro_step_context with one micro-batch, three, and a model without DDP."""

from __future__ import annotations

import random

import torch

from course_grader.checks import case_seed, number, register
from course_grader.grading import max_rel_diff
from course_grader.checks.nb03 import (STEPS, SYNC, TOKEN_STEPS, accumulate_with, big_batch, judge_refusal,
                                    masked_batch, one_round, refusal, sync_case, whole_batch, world_of_one)
from course_grader.grading import forbid, grads, twin
from course_lib.models import build_llama

MICRO_BATCHES = (4, 16, 32)


def accumulate_case():
    """A SmallCNN of width 8 and 32 synthetic images, from a seed new to every grading (``case_seed``)."""
    return sync_case(8, 32, case_seed("nb03", "accumulate"))


def probe_accumulate(ns: dict) -> dict:
    model, x, y = accumulate_case()
    # the model after one run of the student's function, as the visible test leaves its own: a copy starts each run
    try:
        with forbid(*STEPS, namespace=ns):
            ns["accumulate_gradients"](model, x, y, micro_batch=8)
    except Exception:  # the visible test's failure, not this one's
        pass
    out = {}
    for mb in MICRO_BATCHES:
        m2 = twin(model)
        for p in m2.parameters():
            p.grad = torch.full_like(p, 3.0)  # stale gradients, to be discarded
        sizes = []
        hook = m2.features.register_forward_hook(lambda mod, inp, o: sizes.append(int(inp[0].shape[0])))
        try:
            with forbid(*STEPS, namespace=ns):
                ns["accumulate_gradients"](m2, x, y, micro_batch=mb)
        finally:
            hook.remove()
        out[str(mb)] = {"rows": sizes, "grads": grads(m2)}
    return out


def judge_accumulate(got: dict) -> str:
    model, x, y = accumulate_case()
    ref = big_batch(model, x, y)[0]
    for mb in MICRO_BATCHES:
        rows = got[str(mb)]["rows"]
        assert rows, f"micro_batch={mb}: no forward pass ran through the model"
        assert max(rows) <= mb, f"a forward pass saw {max(rows)} rows with micro_batch={mb}"
        assert sum(rows) == len(x), (f"micro_batch={mb}: the forward passes saw {sum(rows)} rows in all, the batch "
                                     f"has {len(x)}: run every row through the model once")
        assert max_rel_diff(got[str(mb)]["grads"], ref) < 1e-5, f"wrong gradient with micro_batch={mb}"
    return "stale gradients discarded, micro-batches of 4, 16 and 32, each forward within micro_batch rows"


register("test_accumulate_gradients_hidden", probe_accumulate, judge_accumulate)

TOKEN_MICRO_BATCHES = (1, 2, 3, 6)


def tokens_case():
    """A tiny Llama (vocabulary 256) and 6 rows of 16 tokens, new to every grading (``case_seed``): the weights, the
    tokens, which pair of rows (0-1, 2-3 or 4-5) scores nothing at all, so that micro-batches of 1 and of 2 rows
    score nothing, and another row whose first labels, from 1 to 14 of them, are masked."""
    seed = case_seed("nb03", "tokens")
    rng = random.Random(seed)
    empty = 2 * rng.randrange(3)
    masks = {empty: 16, empty + 1: 16, rng.choice([r for r in range(6) if r // 2 != empty // 2]): rng.randint(1, 14)}
    return build_llama("tiny", vocab_size=256, seed=seed), masked_batch(6, 16, seed, masks)


def probe_tokens(ns: dict) -> dict:
    lm, batch = tokens_case()
    runs = {}
    for mb in TOKEN_MICRO_BATCHES:
        m2 = twin(lm)
        for p in m2.parameters():
            p.grad = torch.full_like(p, 5.0)  # stale gradients, to be discarded
        with forbid(*TOKEN_STEPS, namespace=ns):
            loss = ns["accumulate_tokens"](m2, batch, micro_batch=mb)
        runs[str(mb)] = {"grads": grads(m2), "loss": number(loss)}
    calls = []
    hook = lm.register_forward_hook(lambda *a: calls.append(1))
    try:
        with forbid(*TOKEN_STEPS, namespace=ns):
            bad = refusal(ns["accumulate_tokens"], lm, batch, micro_batch=4)
    finally:
        hook.remove()
    return {"runs": runs, "bad": {**bad, "forward_passes": len(calls)}}


def judge_tokens(got: dict) -> str:
    ref, want = whole_batch(*tokens_case())
    for mb in TOKEN_MICRO_BATCHES:
        run = got["runs"][str(mb)]
        assert all(torch.isfinite(g).all() for g in run["grads"].values()), f"micro_batch={mb}: nan"
        assert max_rel_diff(run["grads"], ref) < 1e-4, f"micro_batch={mb}: not the whole batch's gradient"
        assert isinstance(run["loss"], (int, float)) and abs(run["loss"] - want) < 1e-4, \
            f"micro_batch={mb}: loss {run['loss']}, expected {want}"
    bad = got["bad"]
    judge_refusal(bad, "micro_batch=4 does not divide 6 rows")
    assert "micro_batch" in bad["message"], "the message should name micro_batch"
    assert not bad["forward_passes"], "check the sizes before any forward pass"
    return "stale gradients, micro-batches of 1, 2, 3 and 6 rows, empty micro-batches, and a bad micro_batch"


register("test_accumulate_tokens_hidden", probe_tokens, judge_tokens)


def sync_shape() -> dict:
    """The CNN's width (a multiple of its GroupNorm's 8 groups), the batch (3 micro-batches of 2 to 8 rows) and the
    seed: new to every grading (``case_seed``)."""
    seed = case_seed("nb03", "micro_step_context")
    rng = random.Random(seed)
    return {"width": rng.choice((8, 16, 24, 32)), "batch": 3 * rng.randint(2, 8), "seed": seed}


def probe_sync(ns: dict) -> dict:
    model, x, y = sync_case(**sync_shape())
    with world_of_one():
        one, three = accumulate_with(ns, model, x, y, 1)[0], accumulate_with(ns, model, x, y, 3)[0]
    plain, contexts = twin(model), []
    for i in range(3):
        with forbid(*SYNC, namespace=ns):
            ctx = ns["micro_step_context"](plain, i, 3)
        contexts.append(hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__"))
        if not contexts[-1]:
            break
        with ctx:
            pass
    return {"one": one, "three": three, "contexts": contexts}


def judge_sync(got: dict) -> str:
    rounds = one_round(*sync_case(**sync_shape()))
    assert got["one"] == [rounds], "accum_steps=1: the only micro-batch must synchronise"
    assert got["three"] == [0, 0, rounds], \
        f"3 micro-batches: all-reduces per micro-batch {got['three']}, expected [0, 0, {rounds}]"
    assert len(got["contexts"]) == 3 and all(got["contexts"]), \
        "return a context manager for every micro-batch, for a model without DDP too"
    return "one micro-batch, three, and a model without DDP"


register("test_micro_step_context_hidden", probe_sync, judge_sync)
