"""course_lib.parallel.cp, cp_cost and cp_torch: ring attention equals full attention, on real gloo ranks.

One fork per world size (2, 3, 4 ranks) runs every check that needs ranks: the ring against SDPA on the
whole sequence (output and q, k, v gradients; causal or not; plain or zig-zag split; a length that divides
and one that does not), and again with the ring given as ``forward`` (notebook 16's way, whose backward is
``gathered_backward``), the tiles each rank computes against ``causal_work``, the bytes it sends against
the formula (``CollectiveBytes`` sees ``isend``/``irecv``), the order it ran (``RingLog``: each pass posted before
its block's attention, waited on after it), the activation bytes against the prediction,
and two known mistakes (a merge that does not rescale, a causal mask on the wrong side) that the
comparison must catch. The course's Llama trains with the ring loss for loss with one process. With grouped K/V heads
(GQA) both forwards, the ring and the all-gather design, equal full attention, and side by side (``compare_designs``)
they send and build what ``ring_bytes_per_rank`` and ``largest_kv_bytes`` predict, kv_heads / heads of MHA's.
torch's own context parallelism (``cp_torch``) needs GPUs: here its path runs up to the kernel, and torch's split
is checked to be the zig-zag.
"""

import dataclasses
import json
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from course_lib.parallel import cp, cp_cost, cp_torch
from course_lib.distributed import CollectiveBytes
from course_lib import attention
from course_lib.launch import on_ranks, run_forked
from course_lib.memory import activation_bytes
from course_lib.models import build_llama

B, H, D = 2, 3, 8
LENGTHS = {2: [8, 7], 3: [12, 10], 4: [16, 10]}  # one that divides by 2N and one that does not
MEMORY_SEQ = 48


def _qkvw(seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, seq, D, generator=g) for _ in range(4)]  # q, k, v, and the loss's weights


def _reference(seq, causal):
    """SDPA over the whole sequence in float64: output and gradients of sum(out * w)."""
    q, k, v, w = (t.double().requires_grad_(i < 3) for i, t in enumerate(_qkvw(seq)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * w).sum().backward()
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


def _wrong_merge(out_a, lse_a, out_b, lse_b):
    """The known mistake: the partial outputs averaged, never rescaled by their softmax sums."""
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def _wrong_mask(q_pos, k_pos, causal, seq_len):
    """The known mistake: the causal mask on the wrong side (later keys kept, earlier ones dropped)."""
    mask = (k_pos < seq_len).expand(len(q_pos), -1)
    return mask & (k_pos[None, :] >= q_pos[:, None]) if causal else mask


def _given_ring(q, k, v, causal, seq_len, zigzag):
    """course_lib's ring forward in notebook 16's contract: ring_attention then backs it with gathered_backward."""
    return cp.ring_forward(q, k, v, causal=causal, seq_len=seq_len, zigzag=zigzag)[:2]


def _ring(rank, world, seq, causal, zigzag, **kw):
    """This rank's (out, dq, dk, dv, send bytes forward, backward) of the ring on its part of the sequence."""
    q, k, v, w = (cp.split_sequence(t, world, zigzag=zigzag)[rank] for t in _qkvw(seq))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with CollectiveBytes() as fwd:
        out = cp.ring_attention(q, k, v, causal=causal, seq_len=seq, zigzag=zigzag, **kw)
    with CollectiveBytes() as bwd:
        (out * w).sum().backward()
    # numpy, not tensors: torch would pass tensors through shared memory the exiting rank takes with it
    return (*(t.detach().numpy() for t in (out, q.grad, k.grad, v.grad)), fwd.bytes_by_kind.get("send", 0),
            bwd.bytes_by_kind.get("send", 0))


def _every_check():
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for seq in LENGTHS[world]:
        for causal in (True, False):
            for zigzag in (False, True):
                results[seq, causal, zigzag] = _ring(rank, world, seq, causal, zigzag)
                results["given", seq, causal, zigzag] = _ring(rank, world, seq, causal, zigzag, forward=_given_ring)
                q, k, v, _ = (cp.split_sequence(t, world, zigzag=zigzag)[rank] for t in _qkvw(seq))
                with CollectiveBytes() as gathered:
                    out = cp.gathered_forward(q, k, v, causal=causal, seq_len=seq, zigzag=zigzag)[0]
                results["gathered", seq, causal, zigzag] = (out.numpy(), gathered.sent_bytes_by_kind)
    seq = LENGTHS[world][0]
    results["wrong merge"] = _ring(rank, world, seq, True, False, merge=_wrong_merge)[0]
    for zigzag in (False, True):  # the tiles the ring computed, counted by the ring itself
        q, k, v, _ = (cp.split_sequence(t, world, zigzag=zigzag)[rank] for t in _qkvw(seq))
        results["work", zigzag] = cp.ring_forward(q, k, v, causal=True, zigzag=zigzag)[2]
    q, k, v, _ = (cp.split_sequence(t, world)[rank] for t in _qkvw(seq))
    swapped = [vars(dist.ProcessGroup)["send"], vars(dist.ProcessGroup)["recv"], vars(dist.Work)["wait"],
               cp.block_attention]
    with cp.RingLog() as log:
        cp.ring_forward(q, k, v, causal=False)
    results["order"] = " ".join(event["what"] for event in log.events)
    results["restored"] = swapped == [vars(dist.ProcessGroup)["send"], vars(dist.ProcessGroup)["recv"],
                                      vars(dist.Work)["wait"], cp.block_attention]
    results["memory"] = cp_cost.measure_ring_memory(MEMORY_SEQ, H, D, batch=B)
    cp.tile_mask = _wrong_mask  # this forked rank's module only
    results["wrong mask"] = _ring(rank, world, seq, True, False)[0]
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_equals_full_attention(world):
    ranks = run_forked(_every_check, world, timeout=120)
    for seq in LENGTHS[world]:
        for causal in (True, False):
            ref = _reference(seq, causal)
            for zigzag in (False, True):
                parts = [r[seq, causal, zigzag] for r in ranks]
                for name, i, want in zip(("out", "dq", "dk", "dv"), range(4), ref):
                    got = cp.merge_sequence([torch.from_numpy(p[i]) for p in parts], seq, zigzag=zigzag)
                    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4,
                                               msg=f"{name}: seq={seq} causal={causal} zigzag={zigzag}")
                    if name in ("dk", "dv"):  # the padded keys are masked: no gradient reaches them
                        padded = cp.merge_sequence([torch.from_numpy(p[i]) for p in parts], zigzag=zigzag)
                        assert (padded[..., seq:, :] == 0).all(), f"{name}: seq={seq} zigzag={zigzag}"
                given = [r["given", seq, causal, zigzag] for r in ranks]  # gathered_backward's gradients
                for name, i, want in zip(("dq", "dk", "dv"), range(1, 4), ref[1:]):
                    got = cp.merge_sequence([torch.from_numpy(p[i]) for p in given], seq, zigzag=zigzag)
                    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4,
                                               msg=f"given ring, {name}: seq={seq} causal={causal} zigzag={zigzag}")
                fwd = cp_cost.ring_bytes_per_rank(seq, H, D, world, 4, batch=B, zigzag=zigzag)
                bwd = cp_cost.ring_backward_bytes_per_rank(seq, H, D, world, 4, batch=B, zigzag=zigzag)
                assert all(p[4] == fwd and p[5] == bwd for p in parts), ([p[4:] for p in parts], fwd, bwd)
                # the all-gather design: the same output, one all-gather sending what the ring's passes send
                gathered = [r["gathered", seq, causal, zigzag] for r in ranks]
                got = cp.merge_sequence([torch.from_numpy(out) for out, _ in gathered], seq, zigzag=zigzag)
                torch.testing.assert_close(got, ref[0], atol=2e-5, rtol=1e-4,
                                           msg=f"gathered_forward: seq={seq} causal={causal} zigzag={zigzag}")
                assert all(sent == {"all_gather": pytest.approx(fwd)} for _, sent in gathered), (gathered[0][1], fwd)
    # the tiles each rank computed: the plain causal ring's imbalance, the zig-zag's balance
    assert [r["work", False] for r in ranks] == cp_cost.causal_work(world)
    assert [r["work", True] for r in ranks] == pytest.approx(cp_cost.causal_work(world, zigzag=True))
    # the order: at each step but the last, the next block's pass is in flight while this block is attended
    assert [r["order"] for r in ranks] == [" ".join(["send recv attend wait wait"] * (world - 1) + ["attend"])] * world
    assert all(r["restored"] for r in ranks), "RingLog leaves torch's methods and block_attention as it found them"
    # memory kept for backward: the prediction, and 1/N of one rank's
    assert all(r["memory"] == cp_cost.attention_activation_bytes(MEMORY_SEQ, H, D, world, batch=B) for r in ranks)
    assert ranks[0]["memory"] * world == cp_cost.measure_ring_memory(MEMORY_SEQ, H, D, batch=B)
    # the known mistakes are caught by the same comparison
    seq = LENGTHS[world][0]
    want = _reference(seq, True)[0]
    for mistake in ("wrong merge", "wrong mask"):
        got = cp.merge_sequence([torch.from_numpy(r[mistake]) for r in ranks], seq)
        assert not torch.allclose(got, want, atol=1e-3), mistake


GQA_HEADS, GQA_SEQ = (8, 2), 30  # query heads, K/V heads; 30 tokens pad to 32 on 4 zig-zag ranks


def _gqa_reference(seq, causal):
    """SDPA over the whole sequence, the K/V heads repeated to the query's: grouped-query attention."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, GQA_HEADS[0], seq, D, generator=g)
    k, v = torch.randn(2, B, GQA_HEADS[1], seq, D, generator=g)
    n_rep = GQA_HEADS[0] // GQA_HEADS[1]
    return (q, k, v), F.scaled_dot_product_attention(q, attention.repeat_kv(k, n_rep), attention.repeat_kv(v, n_rep),
                                                     is_causal=causal)


def _grouped_designs(specs):
    """This rank's grouped-heads outputs of both forwards (causal or not, plain or zig-zag), then ``compare_designs``
    of every spec."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outs = {}
    for causal in (True, False):
        for zigzag in (False, True):
            q, k, v = (cp.split_sequence(t, world, zigzag=zigzag)[rank] for t in _gqa_reference(GQA_SEQ, causal)[0])
            kw = dict(causal=causal, seq_len=GQA_SEQ, zigzag=zigzag)
            outs[causal, zigzag] = [f(q, k, v, **kw)[0].numpy() for f in (cp.ring_forward, cp.gathered_forward)]
    return outs, [cp_cost.compare_designs(spec, repeats=2) for spec in specs]


def test_grouped_heads_in_both_designs_bytes_kv_memory_and_time():
    """4 ranks, 8 query heads on 8 K/V heads (MHA) and on 2 (GQA). Both forwards equal full attention with grouped
    heads; each rank sends the formula's bytes by either design, GQA a quarter of MHA's; the largest K/V tensor the
    all-gather builds is the whole (padded) sequence's, N times the ring's one block."""
    world, (heads, kv_heads) = 4, GQA_HEADS
    specs = [cp_cost.AttentionSpec(seq=GQA_SEQ, heads=heads, head_dim=D, kv_heads=kv, batch=B)
             for kv in (heads, kv_heads)]
    ranks = run_forked(_grouped_designs, world, dict(specs=specs), timeout=120)
    for causal, zigzag in ranks[0][0]:
        want = _gqa_reference(GQA_SEQ, causal)[1]
        for i, design in enumerate(("ring_forward", "gathered_forward")):
            got = cp.merge_sequence([torch.from_numpy(r[0][causal, zigzag][i]) for r in ranks], GQA_SEQ, zigzag=zigzag)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{design}: {causal=} {zigzag=}")
    sent = {}
    for spec, runs in zip(specs, zip(*(r[1] for r in ranks))):
        shape = (spec.seq, spec.kv, spec.head_dim, world, 4)
        fwd = cp_cost.ring_bytes_per_rank(*shape, batch=B, zigzag=True)
        block = cp_cost.largest_kv_bytes(*shape, batch=B, zigzag=True)
        whole = cp_cost.largest_kv_bytes(*shape, batch=B, zigzag=True, gathered=True)
        assert whole == world * block == 2 * B * spec.kv * 32 * D * 4  # 30 tokens padded to 32
        for run in runs:
            assert run["spec"] == dataclasses.asdict(spec) and run["gap"] < 1e-5, run
            assert run["ring"]["sent"] == run["all-gather"]["sent"] == fwd, (run, fwd)
            assert run["ring"]["kv_bytes"] == block and run["all-gather"]["kv_bytes"] == whole, (run, block, whole)
            assert run["ring"]["seconds"] > 0 and run["all-gather"]["seconds"] > 0, run
        sent[spec.kv] = fwd
    assert sent[kv_heads] * heads == sent[heads] * kv_heads  # GQA sends kv_heads / heads of MHA's


def test_grouped_heads_one_rank_and_refusals():
    """One rank: both forwards and block_attention take grouped K/V heads (no repeat) and equal SDPA on repeated ones;
    ring_attention, whose backward needs equal heads, refuses them; a spec whose K/V heads do not divide is refused."""
    (q, k, v), want = _gqa_reference(9, True)
    torch.testing.assert_close(cp.ring_forward(q, k, v, causal=True)[0], want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cp.gathered_forward(q, k, v, causal=True)[0], want, atol=2e-5, rtol=1e-4)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(cp.block_attention(q, k, v, mask)[0], want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="repeat them first"):
        cp.ring_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="do not group"):
        cp.block_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="must divide"):
        cp_cost.AttentionSpec(seq=8, heads=8, head_dim=4, kv_heads=3)
    assert json.loads(json.dumps(dataclasses.asdict(cp_cost.AttentionSpec(seq=8, heads=8, head_dim=4))))["seq"] == 8


def test_ring_llama_trains_like_one_process():
    """The course's Llama with ring attention, 3 steps of AdamW: 3 ranks plain, 4 zig-zag (30 tokens: padded)."""
    reference = cp_torch.reference_llama_losses(3, seq=30)
    for world, zigzag in ((3, False), (4, True)):
        spec = cp_torch.CPRun(steps=3, zigzag=zigzag)
        ranks = [r["losses"] for r in run_forked(cp_torch.train, world, dict(spec=spec), timeout=120)]
        assert all(r == pytest.approx(reference, rel=1e-5) for r in ranks), (world, zigzag, ranks[0], reference)


def test_a_cp_run_is_one_frozen_spec_with_each_design_s_default_length():
    """CPRun: the hand ring's 30 tokens (padded), torch's seq_for the world; a design it does not know, or a field, is
    refused; it crosses JSON as the dict of its fields."""
    assert cp_torch.CPRun().length(4) == cp_torch.RING_SEQ == 30
    assert cp_torch.CPRun(design="torch").length(3) == cp_torch.seq_for(3) == 36
    assert cp_torch.CPRun(design="torch", seq=48).length(3) == 48
    with pytest.raises(ValueError, match="design"):
        cp_torch.CPRun(design="ring")
    with pytest.raises(ValueError, match="no field"):
        cp_torch.CPRun.of({"steps": 2, "world": 4})
    spec = cp_torch.CPRun(steps=2, zigzag=True)
    assert cp_torch.CPRun.of(json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


def test_merge_is_exact_and_the_unscaled_merge_is_not():
    q, k, v, _ = _qkvw(10)
    whole = cp.block_attention(q, k, v)
    a, b = cp.block_attention(q, k[..., :3, :], v[..., :3, :]), cp.block_attention(q, k[..., 3:, :], v[..., 3:, :])
    for merged in (cp.online_softmax_merge(*a, *b), cp.online_softmax_merge(*b, *a)):
        torch.testing.assert_close(merged[0], whole[0])
        torch.testing.assert_close(merged[1], whole[1])
    torch.testing.assert_close(whole[0], F.scaled_dot_product_attention(q, k, v))
    assert not torch.allclose(_wrong_merge(*a, *b)[0], whole[0], atol=1e-3)
    # a block that a row cannot see (lse = -inf) adds nothing and makes no NaN, even merged with another such
    empty = cp.block_attention(q, k[..., :3, :], v[..., :3, :], mask=torch.zeros(10, 3, dtype=torch.bool))
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    torch.testing.assert_close(cp.online_softmax_merge(*a, *empty)[0], a[0])
    both = cp.online_softmax_merge(*empty, *empty)
    assert (both[0] == 0).all() and torch.isneginf(both[1]).all()


def test_one_rank_ring_is_full_attention_with_gradients():
    q, k, v, w = (t.requires_grad_(i < 3) for i, t in enumerate(_qkvw(9)))
    (cp.ring_attention(q, k, v, causal=True) * w).sum().backward()
    ref = _reference(9, True)
    for got, want in zip((q.grad, k.grad, v.grad), ref[1:]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_splits_and_positions():
    x = torch.arange(10.).view(1, 1, 10, 1)
    for world in (2, 3, 4):
        for zigzag in (False, True):
            parts = cp.split_sequence(x, world, zigzag=zigzag)
            assert len({p.shape for p in parts}) == 1  # every rank the same length, padding at the end
            assert torch.equal(cp.merge_sequence(parts, 10, zigzag=zigzag), x)
            for r, p in enumerate(parts):  # the positions a rank claims are the rows it holds
                pos = cp.local_positions(r, world, p.shape[-2], zigzag)
                assert torch.equal(p.flatten(), torch.where(pos < 10, pos, 0).float())
    assert [p.flatten().tolist() for p in cp.zigzag_split(torch.arange(8.).view(1, 1, 8, 1), 2)] == \
        [[0, 1, 6, 7], [2, 3, 4, 5]]  # rank r: chunks r and 2N-1-r


def test_causal_work_and_formulas():
    assert cp_cost.causal_work(4) == [1, 2, 3, 4]  # the last rank does N times the first's work
    assert cp_cost.causal_work(4, zigzag=True) == [2.25] * 4  # 2N+1 quarter blocks each
    # the bytes a rank sends do not fall with N; the activations it keeps do
    assert cp_cost.ring_bytes_per_rank(1024, 8, 64, 2) == 1 * 2 * 8 * 512 * 64 * 4
    assert cp_cost.ring_bytes_per_rank(1024, 8, 64, 8) == 7 * 2 * 8 * 128 * 64 * 4
    assert cp_cost.ring_bytes_per_rank(10, 1, 1, 3, 2) == 2 * 2 * 4 * 2  # 10 tokens pad to 12: 4 per rank
    one, eight = (cp_cost.attention_activation_bytes(4096, 8, 64, n, 2) for n in (1, 8))
    assert one == 8 * eight == 8 * 4096 * (64 * (3 * 2 + 4) + 4)  # heads x rows x (q, k, v bf16; out, lse f32)


def test_a_llama_per_rank_and_the_longest_sequence():
    from course_lib.models import llama_config
    config = llama_config("tiny")
    one, four = (cp_cost.llama_activation_bytes_per_rank(config, 4096, n) for n in (1, 4))
    assert one == 4 * four
    fits = cp_cost.longest_sequence(config, one, 1)
    assert fits == 4096 and cp_cost.longest_sequence(config, one, 4) == 4 * 4096
    assert cp_cost.llama_activation_bytes_per_rank(config, fits + 1) > one  # one token more does not fit


def test_a_llamas_activations_are_linear_in_the_sequence():
    """Measured with the meter: the same bytes per token at 32, 64 and 128 tokens, and near the formula. A model whose
    attention kept its S x S probabilities (transformers' eager attention) grows faster than S, and is told apart."""
    from course_lib.memory import llama_activation_bytes
    from course_lib.models import llama_config
    seqs = [32, 64, 128]
    measured = cp_cost.llama_activations_by_length(seqs)
    per_token = [measured[s] / s for s in seqs]
    assert max(per_token) / min(per_token) < 1.05, per_token
    config = llama_config("tiny")
    assert all(abs(measured[s] / llama_activation_bytes(config, 1, s, 4) - 1) < 0.1 for s in seqs), measured
    eager = build_llama("tiny", attn_implementation="eager")
    quadratic = {s: activation_bytes(eager, lambda: eager(input_ids=torch.zeros(1, s, dtype=torch.long)).logits.sum())
                 for s in (64, 128)}
    assert quadratic[128] / 128 > 1.1 * quadratic[64] / 64, quadratic  # 1.15: the S x S part grows per token


def test_the_longest_sequence_from_two_peaks():
    # 7 GB fixed, 3 MB a token: 16 GB holds (16 - 7) / 0.003 = 3000 tokens
    assert cp_cost.longest_from_peaks({1000: 10_000_000_000, 2000: 13_000_000_000}, 16_000_000_000) == 3000
    assert cp_cost.longest_from_peaks({2000: 13_000_000_000, 1000: 10_000_000_000}, 16_000_000_000) == 3000
    with pytest.raises(ValueError, match="no growth per token"):
        cp_cost.longest_from_peaks({1000: 5, 2000: 5}, 100)
    with pytest.raises(ValueError, match="needs a GPU"):
        cp_cost.measure_longest_sequence(device="cpu")
    if torch.cuda.is_available():  # the lent GPU's test lane: where one GPU runs out, in a 6 GiB budget
        run = cp_cost.measure_longest_sequence("small", budget_gb=6, probes=(2048, 4096))
        assert run["ran_out"] == {0.8: False, 1.25: True}, run


def test_bad_input_is_refused():
    q = torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="local length must be even"):
        cp.ring_attention(q, q, q, causal=True, zigzag=True)
    with pytest.raises(ValueError, match="must be"):
        cp.ring_attention(q, q[..., :4, :], q, causal=True)
    with pytest.raises(ValueError, match="seq_len=9"):
        cp.ring_attention(q, q, q, causal=True, seq_len=9)


def test_torch_context_parallel_needs_a_gpu():
    """On a CPU machine: refused, with why. On a GPU machine (the lent GPU's test lane): it trains, one rank per GPU,
    loss for loss with one process, torch's split the zig-zag."""
    assert "GPU" in cp_torch.support("cpu")
    if not torch.cuda.is_available():
        assert cp_torch.support("cuda") is not None
        return
    world = min(torch.cuda.device_count(), 2)
    runs = on_ranks(cp_torch.train, world, "cuda", timeout=300, spec=cp_torch.CPRun(design="torch", steps=2))
    reference = cp_torch.reference_llama_losses(2, seq=cp_torch.seq_for(world))
    assert all(r["zigzag"] for r in runs)
    assert max(abs(a - b) / b for a, b in zip(runs[0]["losses"], reference)) < 1e-4, (runs[0]["losses"], reference)


def test_torch_cps_llama_gets_no_mask_whatever_its_positions(monkeypatch):
    """transformers reads the zig-zag's jump in positions as a packed sequence and masks across it (the course's
    default Llama does, found here before any GPU ran it); cp_torch's Llama hands SDPA no mask and is_causal, the
    call torch's context swaps for its ring. Same weights, same logits on plain positions."""
    calls, real = [], attention.fused_sdpa

    def watched(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        calls.append((attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(attention, "fused_sdpa", watched)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    zigzag = cp.local_positions(0, 2, 16, True).expand(2, -1)  # rank 0 of 2: chunks 0 and 3 of 4, 0..7 and 24..31
    default, ours = build_llama("tiny"), cp_torch.llama()
    default(input_ids=ids, position_ids=zigzag)
    assert calls and not any(no_mask for no_mask, _ in calls), calls  # the trap: a block mask at the jump
    calls.clear()
    ours(input_ids=ids, position_ids=zigzag)
    assert calls and all(no_mask and causal for no_mask, causal in calls), calls
    assert torch.allclose(ours(input_ids=ids).logits, default(input_ids=ids).logits)


def test_torch_cps_ring_gets_equal_heads_never_grouped_ones(monkeypatch):
    """The tiny Llama groups 4 query heads on 2 K/V heads, and the course's attention hands SDPA grouped heads where
    a fused kernel takes them (``enable_gqa``: the GPUs' kernels do, and torch 2.13's CPU flash kernel; torch 2.7's
    does not, and gets them repeated). Inside torch's context-parallel ring grouped heads take a path torch's own
    tests do not cover, so cp_torch's Llama repeats K/V first: every call torch's context would swap gets equal
    heads, and the logits stay the default Llama's."""
    calls, real = [], F.scaled_dot_product_attention

    def watched(q, k, v, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], v.shape[1], bool(kwargs.get("enable_gqa", False))))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", watched)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    default, ours = build_llama("tiny"), cp_torch.llama()
    want = default(input_ids=ids).logits
    grouped_here = all(k < q and gqa for q, k, _, gqa in calls)  # where the fused kernel takes grouped heads
    assert calls and (grouped_here or torch.__version__ < "2.8"), calls
    calls.clear()
    got = ours(input_ids=ids).logits
    assert calls and all(q == k == v and not gqa for q, k, v, gqa in calls), calls
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("version, hip, host_checked, gated", [
    ("2.14.0a0+git1234", "7.1.25424", False, True),  # both workshop images' torch on ROCm: AOTriton's fault
    ("2.14.0a0+git1234", "7.1.25424", True, False),  # the host ran the preflight's step and opened it
    ("2.15.0a0+rocm7.2", "7.2", False, False),  # the release with the fix (a pre-release of it counts)
    ("2.14.0+cu130", None, False, False),  # CUDA: no gate
])
def test_torch_cp_is_gated_on_rocm_below_the_fixed_release(version, hip, host_checked, gated):
    reason = cp_torch.rocm_gate(version, hip, host_checked)
    assert (reason is not None) == gated, reason
    assert not gated or ("AOTriton" in reason and cp_torch.ROCM_CP_ENV in reason and "preflight" in reason)


def test_support_asks_the_rocm_gate_where_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "7.1.25424")
    monkeypatch.setattr(torch, "__version__", "2.14.0a0+git1234")
    monkeypatch.delenv(cp_torch.ROCM_CP_ENV, raising=False)
    assert "AOTriton" in cp_torch.support("cuda")
    monkeypatch.setenv(cp_torch.ROCM_CP_ENV, "1")
    assert cp_torch.support("cuda") is None


def _forced_torch_cp(seq: int) -> str:
    """cp_torch.train's design "torch" forced onto this CPU rank: the traceback of where it stopped."""
    try:
        cp_torch.train(cp_torch.CPRun(design="torch", steps=1, seq=seq, force=True))
    except Exception:  # noqa: BLE001 - the test reads which error, and where
        return traceback.format_exc()
    return "ran"


def test_torch_cps_llama_draws_its_weights_where_the_reference_does():
    """The same seed draws other weights on a GPU's generator than on the CPU's, and cp_torch's Llama is compared
    loss for loss with its reference, built on the CPU: its weights must be drawn on the CPU too, whatever
    device it runs on. The meta device stands in for a GPU: every random draw must still land on a CPU tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Draws(TorchDispatchMode):
        devices: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("normal_", "uniform_", "bernoulli_", "random_"):
                self.devices.add(args[0].device.type)
            return func(*args, **(kwargs or {}))

    with Draws() as draws:
        model = cp_torch.llama(seed=3, device="meta")
    assert draws.devices == {"cpu"}, f"random weights drawn on {draws.devices}"
    assert {p.device.type for p in model.parameters()} == {"meta"}
    reference = build_llama("tiny", seed=3)
    again = cp_torch.llama(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.state_dict().values()))


def test_torch_context_parallel_goes_the_gpus_way_up_to_the_kernel():
    """The GPU path forced on 2 CPU ranks: mesh, in-place sharding of the batch, the course's Llama unchanged, up to
    the SDPA that torch's context swapped in, where the CPU has no kernel it can ring. A GPU runs on from there."""
    for tb in run_forked(_forced_torch_cp, 2, dict(seq=cp_torch.SEQ), timeout=120):
        assert "course_lib/attention.py" in tb and "fused_sdpa" in tb, tb[-2000:]  # the Llama's own attention call
        assert "tensor/experimental" in tb, tb[-2000:]  # ... entered torch's context-parallel SDPA
        assert "sharding strategy" in tb or "No available kernel" in tb, tb[-2000:]  # ... which has no CPU kernel
    refused = run_forked(_forced_torch_cp, 2, dict(seq=30), timeout=60)  # 30 tokens do not cut into 2·2 chunks
    assert all("use a multiple of 4" in tb for tb in refused), refused[0][-1000:]
    with pytest.raises(Exception, match="it needs GPUs"):
        run_forked(cp_torch.train, 2, dict(spec=dict(design="torch", steps=1)), timeout=60)  # unforced: refused


def _torch_split(seq: int) -> bool:
    """torch's context_parallel cuts a positions buffer on this rank as the zig-zag split does."""
    world = dist.get_world_size()
    positions = torch.arange(seq).expand(2, -1).contiguous()
    mesh = init_device_mesh("cpu", (world,))
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}):
        return torch.equal(positions[0], cp.local_positions(dist.get_rank(), world, seq // world, True))


def test_torchs_load_balancer_is_the_zigzag_split():
    """What cp_torch.train checks on GPU ranks, checked here: torch's head-tail split is notebook 16's."""
    for world in (2, 4):
        assert all(run_forked(_torch_split, world, dict(seq=32), timeout=60))
