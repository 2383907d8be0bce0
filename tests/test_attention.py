"""The course's attention: the same numbers as transformers' SDPA, a fused kernel in every dtype, and a
fallback to the math kernel that raises instead of silently storing T×T."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from course_lib import attention as att
from course_lib.grading import max_rel_diff
from course_lib.memory import SavedTensorMeter
from course_lib.models import build_llama


def tokens(batch=2, t=32, vocab=512, seed=0):
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, x, **kw):
    model.zero_grad()
    loss = model(input_ids=x, labels=x, **kw).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("packed", [False, True])
def test_course_sdpa_equals_transformers_sdpa(packed):
    x = tokens()
    kw = {"position_ids": torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)} if packed else {}
    ours, theirs = build_llama("tiny"), build_llama("tiny", attn_implementation="sdpa")
    la, ga = loss_and_grads(ours, x, **kw)
    lb, gb = loss_and_grads(theirs, x, **kw)
    assert torch.allclose(la, lb, rtol=1e-6)
    assert max_rel_diff(dict(enumerate(ga)), dict(enumerate(gb))) < 1e-5
    if packed:  # the position reset made a document mask: document 2 sees nothing of document 1
        alone = ours(input_ids=x[:, 12:]).logits
        assert torch.allclose(ours(input_ids=x, **kw).logits[:, 12:], alone, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_call_runs_a_fused_kernel_forward_and_backward(dtype):
    model, x = build_llama("tiny"), tokens()
    layers = model.config.num_hidden_layers

    def step():
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            model(input_ids=x, labels=x).loss.backward()

    ran = att.attention_kernels(step)
    assert ran == {"flash": 2 * layers}, ran  # one forward and one backward op per layer, none of them math


def test_the_kernel_meter_sees_a_forced_fallback():
    model, x = build_llama("tiny", attn_implementation="sdpa"), tokens()

    def step():
        with sdpa_kernel([SDPBackend.MATH]):
            model(input_ids=x, labels=x).loss.backward()

    assert set(att.attention_kernels(step)) == {"math"}


def test_a_fallback_raises_and_says_what_to_change():
    model, x = build_llama("tiny", attention_dropout=0.1), tokens()
    model.train()  # dropout inside attention: no fused CPU kernel runs it
    with pytest.raises(att.AttentionFallback, match="dropout 0.1.*attention dropout 0"):
        model(input_ids=x, labels=x)
    model.eval()  # no dropout in eval: the fused kernel runs
    assert att.attention_kernels(lambda: model(input_ids=x)) == {"flash": model.config.num_hidden_layers}
    q = torch.randn(1, 4, 16, 8)
    mask = torch.zeros(16, 16, requires_grad=True)  # a learned additive mask needs the math kernel's gradient
    with pytest.raises(att.AttentionFallback, match="requires_grad=True"):
        att.fused_sdpa(q, q, q, attn_mask=mask)


def test_grouped_heads_are_repeated_where_no_fused_kernel_takes_them():
    # on CUDA and ROCm only FlashAttention takes grouped K/V heads, and only in half precision without a mask
    assert not att.gqa_runs_fused("cuda", torch.float32, masked=False)
    assert not att.gqa_runs_fused("cuda", torch.bfloat16, masked=True)
    assert att.gqa_runs_fused("cuda", torch.bfloat16, masked=False) and att.gqa_runs_fused("cpu", torch.float32, True)
    q, k = torch.randn(2, 8, 16, 4), torch.randn(2, 2, 16, 4)
    full = att.repeat_kv(k, 4)
    assert full.shape == (2, 8, 16, 4) and torch.equal(full[:, 5], k[:, 1])  # query head 5 is in group 1
    grouped = att.fused_sdpa(q, k, k, is_causal=True)
    expanded = torch.nn.functional.scaled_dot_product_attention(q, full, full, is_causal=True)
    assert torch.allclose(grouped, expanded, atol=1e-6)


def test_the_math_fallback_stores_the_probabilities_and_the_fused_kernel_does_not():
    b, h, t, d = 1, 4, 256, 16
    q = torch.randn(b, h, t, d, requires_grad=True)
    saved = {}
    for name, backend in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION)):
        with SavedTensorMeter() as meter, sdpa_kernel([backend]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        saved[name] = meter.bytes
    probabilities = b * h * t * t * 4
    assert saved["math"] >= probabilities  # the T×T matrix, in fp32
    assert saved["flash"] < probabilities / 4  # q, k, v, the output and one log-sum-exp per row
