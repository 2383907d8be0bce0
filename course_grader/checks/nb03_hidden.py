"""Notebook 03's hidden tests (instructor edition only): stale gradients and other splits, a micro-batch that scores
nothing, and micro_step_context with one micro-batch, three, and a model without DDP."""

from __future__ import annotations

import torch

from course_grader.checks import number, register
from course_grader.grading import max_rel_diff
from course_grader.checks.nb03 import (STEPS, SYNC, TOKEN_STEPS, accumulate_with, big_batch, cnn_case, judge_refusal,
                                    masked_batch, one_round, refusal, setup_shape, sync_case, token_case, whole_batch,
                                    world_of_one)
from course_grader.grading import forbid, grads, twin

MICRO_BATCHES = (4, 16, 32)


def probe_accumulate(ns: dict) -> dict:
    model, x, y = cnn_case()
    # the model as the visible test left it (the student's function ran on it once): a copy of it starts each run
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
    _, x, _ = cnn_case()
    ref = big_batch(*cnn_case())[0]
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


def token_case2() -> dict:
    """6 rows of 16 tokens: rows 0 and 1 score nothing at all, row 2 its last 13 labels."""
    return masked_batch(6, 16, 5, {0: 16, 1: 16, 2: 3})


def probe_tokens(ns: dict) -> dict:
    lm, batch = token_case()[0], token_case2()
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
    ref, want = whole_batch(token_case()[0], token_case2())
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


def probe_sync(ns: dict) -> dict:
    shape = setup_shape(ns)
    model, x, y = sync_case(**shape)
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
    return {**shape, "one": one, "three": three, "contexts": contexts}


def judge_sync(got: dict) -> str:
    rounds = one_round(*sync_case(got["width"], got["batch"], got["seed"]))
    assert got["one"] == [rounds], "accum_steps=1: the only micro-batch must synchronise"
    assert got["three"] == [0, 0, rounds], \
        f"3 micro-batches: all-reduces per micro-batch {got['three']}, expected [0, 0, {rounds}]"
    assert len(got["contexts"]) == 3 and all(got["contexts"]), \
        "return a context manager for every micro-batch, for a model without DDP too"
    return "one micro-batch, three, and a model without DDP"


register("test_micro_step_context_hidden", probe_sync, judge_sync)
