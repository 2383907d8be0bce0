"""Notebook 03's visible tests: accumulated gradients against the big batch's, a bad micro_batch refused,
token-weighted accumulation on masked rows, and the all-reduces of micro_step_context under DDP."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import course_lib.loss as loss_lib
import course_lib.train as train
from course_grader.checks import error_message, number, register
from course_grader.grading import forbid, grads, max_rel_diff, twin
from course_lib.data import random_tokens, synthetic_images
from course_lib.distributed import AllReduceCounter
from course_lib.loss import forward_loss
from course_lib.models import SmallCNN, build_llama

# What each exercise builds, out of reach while the student's code runs.
STEPS = (train.train_step, train.fit, train.split_batch, train.token_weights)
TOKEN_STEPS = (train.train_step, train.fit, train.split_batch, train.token_weights, loss_lib.scored_tokens)
SYNC = (train.grad_sync_context, train.train_step, train.fit)


def refusal(fn, *args, **kwargs) -> dict:
    """What ``fn`` raised, as data (``raised`` is None where it returned): whether it was a ValueError (a subclass
    counts, as ``except ValueError`` would), its type's name and its message."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the student's error is data the judge reads
        return {"raised": type(err).__name__, "value_error": isinstance(err, ValueError),
                "message": error_message(err)[:500]}
    return {"raised": None, "value_error": False, "message": ""}


def judge_refusal(got: dict, expected: str) -> None:
    """A refusal as the inline tests asked for it: a ValueError, not another error and not none."""
    assert got["raised"] is not None, f"{expected}: expected ValueError"
    assert got["value_error"], f"{expected}: expected ValueError, got {got['raised']}: {got['message']}"


# ---------------------------------------------------------------- accumulate_gradients
def cnn_case():
    """The tests' model and batch: a SmallCNN of width 8 (seed 1) and 32 synthetic images (seed 1)."""
    torch.manual_seed(1)
    model = SmallCNN(width=8)
    x, y = synthetic_images(32, seed=1).tensors
    return model, x, y


def big_batch(model, x, y) -> tuple[dict, float]:
    """The reference: one forward and backward of the whole batch, on a copy; its gradients and loss."""
    ref = twin(model)
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    return grads(ref), loss.item()


def probe_accumulate(ns: dict) -> dict:
    model, x, y = cnn_case()
    with forbid(*STEPS, namespace=ns):
        loss = ns["accumulate_gradients"](model, x, y, micro_batch=8)
    return {"grads": grads(model), "loss": number(loss)}


def judge_accumulate(got: dict) -> str:
    ref_grads, ref_loss = big_batch(*cnn_case())
    assert max_rel_diff(got["grads"], ref_grads) < 1e-5, "accumulated gradient differs from the big batch's"
    assert isinstance(got["loss"], (int, float)) and abs(got["loss"] - ref_loss) < 1e-5, \
        "the returned loss should be the batch's mean loss"
    return "gradients match the big batch"


register("test_accumulate_gradients", probe_accumulate, judge_accumulate)


def probe_errors(ns: dict) -> dict:
    model, x, y = cnn_case()
    calls = []
    hook = model.features.register_forward_hook(lambda *a: calls.append(1))
    try:
        with forbid(*STEPS, namespace=ns):
            got = refusal(ns["accumulate_gradients"], model, x, y, micro_batch=5)
    finally:
        hook.remove()
    return {**got, "forward_passes": len(calls)}


def judge_errors(got: dict) -> str:
    judge_refusal(got, "micro_batch=5 does not divide 32")
    assert "micro_batch" in got["message"], "the message should name micro_batch"
    assert not got["forward_passes"], "check the sizes before running any forward pass"
    return "bad micro_batch refused"


register("test_accumulate_gradients_errors", probe_errors, judge_errors)


# ---------------------------------------------------------------- accumulate_tokens
def masked_batch(rows: int, seq: int, seed: int, masks: dict) -> dict:
    """Random rows of a 256-token vocabulary, labels = ids, the first ``masks[r]`` labels of row r masked (-100)."""
    ids = random_tokens(rows, seq, 256, seed=seed)
    labels = ids.clone()
    for r, n in masks.items():
        labels[r, :n] = -100
    return {"input_ids": ids, "labels": labels}


def token_case():
    """The tests' tiny Llama (vocabulary 256, seed 4) and the visible test's 8 rows, the first ones almost all
    masked."""
    torch.manual_seed(4)
    return build_llama("tiny", vocab_size=256, seed=4), masked_batch(8, 24, 4, {0: 22, 1: 22, 2: 20, 3: 20, 4: 2})


def whole_batch(lm, batch) -> tuple[dict, float]:
    """The reference: one forward of the whole batch on a copy, transformers' own loss (the token mean), backward."""
    ref = twin(lm)
    ref.zero_grad()
    loss = forward_loss(ref, batch)
    loss.backward()
    return grads(ref), loss.item()


def probe_tokens(ns: dict) -> dict:
    lm, batch = token_case()
    with forbid(*TOKEN_STEPS, namespace=ns):
        loss = ns["accumulate_tokens"](lm, batch, micro_batch=2)
    return {"grads": grads(lm), "loss": number(loss)}


def judge_tokens(got: dict) -> str:
    ref_grads, want = whole_batch(*token_case())
    assert max_rel_diff(got["grads"], ref_grads) < 1e-4, ("the gradient is not the whole batch's: weight each "
                                                          "micro-batch by its share of the scored tokens, not by 1/k")
    assert isinstance(got["loss"], (int, float)) and abs(got["loss"] - want) < 1e-4, \
        f"return the whole batch's token-mean loss ({want:.4f}), not {got['loss']}"
    return "token-weighted accumulation gives the whole batch's gradient"


register("test_accumulate_tokens", probe_tokens, judge_tokens)


# ---------------------------------------------------------------- micro_step_context
@contextlib.contextmanager
def world_of_one():
    """A gloo world of one process for DDP: the notebook's own where it has one (section 5 made it), else one made
    here (an in-memory store: no port) and taken down after."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def setup_shape(ns: dict) -> dict:
    """The notebook's section-1 sizes, from its setup cell: the CNN's width, the batch, the seed."""
    return {"width": int(ns["size"]["width"]), "batch": int(ns["size"]["batch"]), "seed": int(ns["seed"])}


def sync_case(width: int, batch: int, seed: int):
    """The notebook's model and first batch (section 1's ``model``, ``x``, ``y``), on the CPU, built from the seed."""
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    images, labels = synthetic_images(batch * 8, seed=seed).tensors
    return model, images[:batch], labels[:batch]


def accumulate_with(ns: dict, model, x, y, steps: int) -> tuple[list[int], dict]:
    """``steps`` micro-batches through a DDP copy of ``model``, each under the student's context: the all-reduces
    each micro-batch caused, and the gradients."""
    m = DDP(twin(model))
    counter = AllReduceCounter().attach(m)
    m.zero_grad(set_to_none=True)
    per_micro = []
    for i, (xm, ym) in enumerate(zip(x.chunk(steps), y.chunk(steps))):
        before = counter.calls
        with forbid(*SYNC, namespace=ns):
            ctx = ns["micro_step_context"](m, i, steps)
        with ctx:
            (F.cross_entropy(m(xm), ym) / steps).backward()
        per_micro.append(counter.calls - before)
    return per_micro, {n.removeprefix("module."): v for n, v in grads(m).items()}


def one_round(model, x, y) -> int:
    """The reference: the bucket all-reduces of one backward of the whole batch through DDP (course_lib's counter)."""
    with world_of_one():
        m = DDP(twin(model))
        counter = AllReduceCounter().attach(m)
        F.cross_entropy(m(x), y).backward()
        calls = counter.calls
        del m
    return calls


def probe_sync(ns: dict) -> dict:
    shape = setup_shape(ns)
    model, x, y = sync_case(**shape)
    with world_of_one():
        per_micro, got = accumulate_with(ns, model, x, y, 4)
    return {**shape, "per_micro": per_micro, "grads": got}


def judge_sync(got: dict) -> str:
    model, x, y = sync_case(got["width"], got["batch"], got["seed"])
    rounds, per_micro = one_round(model, x, y), got["per_micro"]
    assert sum(per_micro) == rounds, f"expected {rounds} bucket all-reduces (one round), got {sum(per_micro)}"
    assert per_micro[-1] == rounds, f"all-reduces per micro-batch {per_micro}: synchronise on the last one"
    assert max_rel_diff(got["grads"], big_batch(model, x, y)[0]) < 1e-5, \
        "the accumulated, synchronised gradient is wrong"
    return "one all-reduce round per optimizer step, on the last micro-batch"


register("test_micro_step_context", probe_sync, judge_sync)
