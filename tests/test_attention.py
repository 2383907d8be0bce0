"""The course's attention: the same numbers as transformers' SDPA, a fused kernel in every dtype, and a
fallback to the math kernel that raises instead of silently storing T×T."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from course_grader.grading import max_rel_diff
from course_lib import attention as att
from course_lib.memory import SavedTensorMeter
from course_lib.models import build_llama, empty_llama


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


def kv_heads_seen(fn) -> list[int]:
    """The K/V head count each fused attention kernel received while ``fn()`` ran (forward ops only)."""
    with att._quiet_stderr(), torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[1][1] for e in prof.events() if att.KERNEL_OPS.get(e.name) not in (None, "math")]


def qkv(kv_heads: int, heads: int = 8, t: int = 16, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, t, d, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads))
    return q, k, v


def reference(q, k, v, mask, is_causal):
    """torch's math attention in fp32 on K/V repeated by hand, and its gradients."""
    n_rep = q.shape[1] // k.shape[1]
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q2, k2.repeat_interleave(n_rep, 1), v2.repeat_interleave(n_rep, 1), attn_mask=mask, is_causal=is_causal)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in (q2, k2, v2)]


def assert_matches_reference(attend, q, k, v, mask, is_causal, tol):
    out = attend()
    out.float().backward(torch.ones_like(out, dtype=torch.float32))
    ref, ref_grads = reference(q, k, v, mask, is_causal)
    assert max_rel_diff({"out": out.detach().float()}, {"out": ref}) < tol
    assert max_rel_diff(dict(enumerate(t.grad for t in (q, k, v))), dict(enumerate(ref_grads))) < tol


def document_mask(t: int = 16, split: int = 6) -> torch.Tensor:
    """(1, 1, T, T) bool: causal within two packed documents, as transformers' mask for packed rows."""
    doc = torch.arange(t) >= split
    return (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()[None, None]


def cpu_flash_runs_grouped_heads(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU FlashAttention really runs K/V with fewer heads than Q (2.13 does, 2.7 does not)."""
    q, k = torch.randn(1, 4, 8, 8, dtype=dtype), torch.randn(1, 2, 8, 8, dtype=dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch says why flash declined: the answer is enough
            torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "mha"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_dispatcher_decides_once_per_kind_of_call(dtype, masked, grouped, monkeypatch):
    monkeypatch.setattr(att, "_PLANS", {})
    asked, real = [], att.sdpa_backend
    monkeypatch.setattr(att, "sdpa_backend", lambda *a, **kw: asked.append(kw["enable_gqa"]) or real(*a, **kw))
    q, k, v = qkv(kv_heads=2 if grouped else 8)
    mask = document_mask() if masked else None

    def attend():
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            return att.fused_sdpa(q, k, v, attn_mask=mask, is_causal=not masked)

    for _ in range(3):
        attend()
    takes_grouped = not grouped or cpu_flash_runs_grouped_heads(dtype)
    # asked once (grouped heads first, then repeated only where declined); every later call pays a dict lookup
    assert asked == ([grouped] if takes_grouped else [True, False]), asked
    assert set(kv_heads_seen(attend)) == {k.shape[1] if takes_grouped else q.shape[1]}
    assert_matches_reference(attend, q, k, v, mask, not masked, tol=1e-5 if dtype == torch.float32 else 2e-2)


def gpu_dispatcher(grouped: SDPBackend | None, repeated: SDPBackend | None):
    """What a GPU's dispatcher answers in course_sdpa's context (only fused kernels allowed): ``grouped`` for K/V
    with fewer heads than Q, ``repeated`` for one K/V head per query head; None: no allowed kernel, and torch raises."""
    def choice(query, key, value, *args, enable_gqa=False, **kwargs):
        answer = grouped if key.shape[1] != query.shape[1] else repeated
        if answer is None:
            raise RuntimeError("No available kernel.  Aborting execution.")
        return answer
    return choice


def test_the_layout_follows_the_dispatchers_answers():
    asked = []

    def answers(grouped, repeated):
        return lambda as_grouped: asked.append(as_grouped) or (grouped if as_grouped else repeated)

    # AOTriton's flash refusing grouped heads (ROCm, several releases): repeat, flash runs
    assert att.kv_layout(answers(None, SDPBackend.FLASH_ATTENTION)) == "repeated"
    assert att.kv_layout(answers(SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION)) == "repeated"
    asked.clear()  # CUDA since torch 2.14: the memory-efficient kernel takes grouped heads, in fp32 too: no repeat
    assert att.kv_layout(answers(SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION)) == "grouped"
    assert asked == [True]  # the repeated layout is not even asked about
    assert att.kv_layout(answers(SDPBackend.MATH, None)) == "fallback"
    assert att.kv_layout(answers(None, SDPBackend.FLASH_ATTENTION), grouped_heads=False) == "fallback"


GPU_CASES = {  # (grouped answer, repeated answer) -> K/V heads the kernel gets, or None: AttentionFallback
    "rocm-flash-refuses-grouped": (None, SDPBackend.FLASH_ATTENTION, 8),
    "cuda-efficient-takes-grouped": (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, 2),
    "cudnn-only-repeated": (None, SDPBackend.CUDNN_ATTENTION, 8),
    "both-fall-back": (None, None, None),
}


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_course_sdpa_repeats_only_where_the_gpu_dispatcher_declines_grouped_heads(case, monkeypatch):
    grouped, repeated, heads = GPU_CASES[case]
    monkeypatch.setattr(att, "_PLANS", {})
    monkeypatch.setattr(att, "sdpa_backend", gpu_dispatcher(grouped, repeated))
    module = nn.Module()
    module.is_causal = True
    q, k, v = qkv(kv_heads=2)

    def attend():  # transformers' layout out, (batch, T, heads, d): back to (batch, heads, T, d)
        return att.course_sdpa(module, q, k, v, attention_mask=None)[0].transpose(1, 2)

    if heads is None:
        with pytest.raises(att.AttentionFallback, match="grouped or repeated"):
            attend()
        return
    if heads != q.shape[1] and not cpu_flash_runs_grouped_heads(q.dtype):  # the decision alone: this CPU cannot run it
        signature = att.sdpa_signature(q, k, v, None, 0.0, True, None)
        with sdpa_kernel(att.FUSED_BACKENDS):
            assert att.kv_plan(signature)[0] == "grouped"
        return
    assert set(kv_heads_seen(attend)) == {heads}
    assert_matches_reference(attend, q, k, v, None, True, tol=1e-5)


def test_the_compiled_call_decides_the_same_while_tracing(monkeypatch):
    monkeypatch.setattr(att, "_PLANS", {})
    monkeypatch.setattr(att, "sdpa_backend", gpu_dispatcher(None, SDPBackend.FLASH_ATTENTION))  # ROCm's answers
    q, k, v = qkv(kv_heads=2)
    compiled = torch.compile(att.fused_sdpa, backend="eager", fullgraph=True)  # fullgraph: no break to decide
    assert set(kv_heads_seen(lambda: compiled(q, k, v, is_causal=True))) == {8}
    assert_matches_reference(lambda: compiled(q, k, v, is_causal=True), q, k, v, None, True, tol=1e-5)


def test_the_recipes_compiled_layers_take_new_lengths_and_batch_sizes(monkeypatch):
    """The recipe compiles each decoder layer on a GPU; a fine-tune's padded batches change length, dynamo then
    recompiles with symbolic sizes, and the kernel decision must still be a constant of the graph (on the H100 it
    was not: torch 2.11 stopped notebook 11 with "SymNodeVariable() is not a constant"). Dynamo's eager backend
    traces as a GPU run does (fullgraph: no break allowed); each batch's loss equals the uncompiled model's."""
    from course_lib.recipe import Recipe, prepare

    compile_module = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager", fullgraph=True))
    monkeypatch.setattr(att, "_PLANS", {})
    torch._dynamo.reset()
    eager = build_llama("tiny")
    compiled = prepare(build_llama("tiny"), Recipe(compile=True, frozen_weights_bf16=False))
    compiled.load_state_dict(eager.state_dict())
    for batch, t in ((4, 16), (4, 24), (3, 40), (1, 12)):  # from the second on, sizes are symbols
        ids = tokens(batch, t, seed=t)
        mask = torch.ones(batch, t, dtype=torch.long)
        mask[0, t // 2 + 1:] = 0  # a padded row: the attention mask is a tensor, not is_causal
        got, want = (m(input_ids=ids, attention_mask=mask, labels=ids).loss for m in (compiled, eager))
        assert float(got) == pytest.approx(float(want), rel=1e-5), (batch, t)
    # decided while tracing: on layouts, at the traced size (1 for a one-row batch), never at a length seen above
    traced = [key[0][2] for key in att._PLANS if key[0][2][1] in ("bhsd", "bshd")]  # the query's metadata
    assert traced and all(shape[0] in (1, att.TRACED_SIZE) and shape[2] == att.TRACED_SIZE for shape, *_ in traced)
    # notebook 11 scores by greedy generation on the same compiled layers: one-token queries on a growing cache
    ids, mask = tokens(2, 12, seed=1), torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as generation pads
    got, want = (m.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                   pad_token_id=0) for m in (compiled, eager))
    assert torch.equal(got, want)


def test_the_meta_init_model_attends_as_build_llama_does():
    model = empty_llama("tiny", attention_dropout=0.1)  # notebook 08's meta-device initialisation
    model.to_empty(device="cpu")
    assert model.config._attn_implementation == build_llama("tiny").config._attn_implementation == att.IMPLEMENTATION
    model.train()  # dropout inside attention: course_sdpa refuses the math fallback that "sdpa" would take silently
    with pytest.raises(att.AttentionFallback):
        model(input_ids=tokens())


def test_repeat_kv_gives_each_query_head_its_groups_head():
    k = torch.randn(2, 2, 16, 4)
    full = att.repeat_kv(k, 4)
    assert full.shape == (2, 8, 16, 4) and torch.equal(full[:, 5], k[:, 1])  # query head 5 is in group 1
    with pytest.raises(ValueError, match="must be equal and divide"):
        att.fused_sdpa(torch.randn(2, 8, 16, 4), torch.randn(2, 3, 16, 4), torch.randn(2, 3, 16, 4))


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
