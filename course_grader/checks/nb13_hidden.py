"""Notebook 13's hidden tests (instructor edition only): the chunked cross-entropy on a token count the chunk does not
divide and a chunk larger than the tokens, with the loss scaled before backward, on logits large enough to overflow
exp() unshifted, in bf16, with every target ignored, and its largest tensor on a small chunk."""

from __future__ import annotations

import torch

from course_grader.checks import case_seed, register
from course_grader.checks.nb13 import case, judge_largest, judge_values, probe_loss

# (label, tokens, d, vocab, chunk, case keywords, grad_scale, tolerance)
CASES = (("61 tokens, chunks of 8, the loss times 3", 61, 8, 96, 8, {}, 3.0, 1e-5),
         ("40 tokens, one chunk of 128", 40, 8, 96, 128, {}, 1.0, 1e-5),
         ("logits in the hundreds", 37, 8, 64, 8, {"scale": 60.0}, 1.0, 1e-5),
         ("bf16 states and weight", 48, 16, 80, 16, {"dtype": torch.bfloat16}, 1.0, 2e-2),
         ("every target ignored", 24, 8, 32, 8, {"ignored": "all"}, 1.0, 1e-5))
SMALL_CHUNK = ("61 tokens, chunks of 4", 61, 8, 96, 4)


def inputs(label: str, tokens: int, d: int, vocab: int, keywords: dict):
    return case(tokens, d, vocab, seed=case_seed("nb13", label), **keywords)


def probe(ns: dict) -> dict:
    got = {label: probe_loss(ns, *inputs(label, n, d, v, kw), chunk, scale)
           for label, n, d, v, chunk, kw, scale, _ in CASES}
    label, n, d, v, chunk = SMALL_CHUNK
    got[label] = probe_loss(ns, *inputs(label, n, d, v, {}), chunk, watch=True)
    return got


def judge(got: dict) -> str:
    for label, n, d, v, chunk, kw, scale, tol in CASES:
        judge_values(got[label], *inputs(label, n, d, v, kw), label=label, grad_scale=scale, tol=tol)
    label, n, d, v, chunk = SMALL_CHUNK
    judge_largest(got[label], n, d, v, chunk, label)
    return ("a last chunk shorter than the rest, one chunk larger than the tokens, the loss scaled, large logits, "
            "bf16, every target ignored, and chunks of 4")


register("test_chunked_cross_entropy_hidden", probe, judge)
