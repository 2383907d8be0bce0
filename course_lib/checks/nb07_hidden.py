"""Notebook 07's hidden tests (instructor edition only): padding and a pad id equal to EOS, merge and dropout against
peft's layer, the LoRA count on other layers and Llama-3.1-8B, and NF4 on many blocks."""

from __future__ import annotations

import torch

from course_lib.checks import register
from course_lib.checks.nb07 import (LABELLING, PEFT, is_tensor, labelling_batch, my_nf4, my_pair, peft_count, small_config,
                                    student_count, student_labels, tensor, their_pair)
from course_lib.grading import forbid
from course_lib.lora import ALL_LINEAR
from course_lib.models import llama_config


# ---------------------------------------------------------------- response_labels
EOS_IDS = [[5, 6, 7, 2, 2, 2], [5, 6, 8, 9, 2, 2]]  # pad id 2 == EOS id 2
EOS_WANT = [[-100, -100, 7, 2, -100, -100], [-100, -100, 8, 9, 2, -100]]


def probe_labels(ns: dict) -> dict:
    batch = student_labels(ns)
    with forbid(*LABELLING, namespace=ns):
        got = ns["response_labels"](torch.tensor(EOS_IDS), [2, 2], [4, 5])
    return {"batch": batch["labels"], "eos": tensor(got)}


def judge_labels(got: dict) -> str:
    batch, _, _ = labelling_batch()
    is_tensor(got["batch"], "labels")
    assert torch.equal(got["batch"], batch["labels"]), "padding positions must be -100 too"
    want = torch.tensor(EOS_WANT)
    is_tensor(got["eos"], "labels")
    assert torch.equal(got["eos"], want), f"expected {want.tolist()}, got {got['eos'].tolist()}"
    assert got["eos"].dtype == torch.long
    return "padding masked, and a pad id equal to EOS"


register("test_response_labels_hidden", probe_labels, judge_labels)


# ---------------------------------------------------------------- LoRALinear: merge, unmerge, dropout
MERGE = dict(r=8, alpha=4, shape=(2, 3, 16), seed=5)  # scaling 0.5, a (batch, seq, in) input
DROPOUT = dict(r=4, alpha=8, dropout=0.5, seed=6)


def probe_merge(ns: dict) -> dict:
    mine, x = my_pair(ns, **MERGE)
    out = {}
    with torch.no_grad():
        with forbid(*PEFT, namespace=ns):
            out["y"] = tensor(mine(x))
            mine.merge()
            out["w merged"] = tensor(mine.base.weight)
            mine.merge()
            out["w merged twice"] = tensor(mine.base.weight)
            out["merged"] = bool(mine.merged)
            out["y merged"] = tensor(mine(x))
        with forbid(*PEFT, namespace=ns):
            mine.unmerge()
            out["merged after unmerge"] = bool(mine.merged)
            out["w unmerged"] = tensor(mine.base.weight)
            out["y unmerged"] = tensor(mine(x))
    mine, x = my_pair(ns, **DROPOUT)
    mine.train()
    with forbid(*PEFT, namespace=ns):
        torch.manual_seed(11)
        out["y dropout"] = tensor(mine(x))
    return out


def judge_merge(got: dict) -> str:
    base, theirs, x = their_pair(**MERGE)
    with torch.no_grad():
        y_ref = theirs(x)
        for key in ("y", "w merged", "w merged twice", "y merged", "w unmerged", "y unmerged"):
            is_tensor(got[key], key)
        y = got["y"]
        assert torch.allclose(y, y_ref, atol=1e-5), "r=8, alpha=4: the update is scaled by alpha / r = 0.5"
        assert torch.equal(got["w merged twice"], got["w merged"]), "merging twice must not add the update twice"
        assert got["merged"] and torch.allclose(got["y merged"], y, atol=1e-5), "the merged layer computes the same outputs"
        theirs.merge()
        assert torch.allclose(got["w merged"], theirs.base_layer.weight, atol=1e-6), "merge: W + (alpha / r) * B @ A, as peft's"
        assert not got["merged after unmerge"] and torch.allclose(got["w unmerged"], base.weight, atol=1e-6), \
            "unmerge restores W"
        assert torch.allclose(got["y unmerged"], y, atol=1e-5)
    _, theirs, x = their_pair(**DROPOUT)
    theirs.train()
    torch.manual_seed(11)
    y_ref = theirs(x)
    is_tensor(got["y dropout"], "the layer's output")
    assert torch.allclose(got["y dropout"], y_ref, atol=1e-5), \
        "dropout belongs on the adapter's input: lora_B(lora_A(dropout(x)))"
    return "merge and unmerge as peft's, merging twice, alpha / r = 0.5, a 3-D input, dropout on the adapter's input"


register("test_LoRALinear_hidden", probe_merge, judge_merge)


# ---------------------------------------------------------------- lora_params: other layers, other ranks, 8B
TARGETS = ((("k_proj", "v_proj"), 8), (("gate_proj", "up_proj", "down_proj"), 2), (ALL_LINEAR, 16))


def probe_count(ns: dict) -> dict:
    return {"tiny": [student_count(ns, small_config(), r, targets) for targets, r in TARGETS],
            "8b": student_count(ns, llama_config("8b"), 16, ALL_LINEAR)}


def judge_count(got: dict) -> str:
    for (targets, r), n in zip(TARGETS, got["tiny"]):
        assert n == peft_count(r, targets), (targets, r)
    assert got["8b"] == 41_943_040
    return "k_proj and v_proj under grouped-query attention, the MLP, other ranks, and Llama-3.1-8B"


register("test_lora_params_hidden", probe_count, judge_count)


# ---------------------------------------------------------------- nf4_quantize: many blocks
def many_blocks() -> dict:
    """The inputs, drawn in the order the test had them: 150 values in blocks of 64, 64 and 22; 400 in 3 × 128 and
    16; an all-zero block; a block ten thousand times larger than the next."""
    torch.manual_seed(1)
    many = [(torch.randn(shape) * 0.02, bs) for shape, bs in (((5, 30), 64), ((2, 200), 128))]
    zero = torch.randn(3, 64)
    zero[1] = 0.0
    scales = torch.randn(2, 64) * 1e-3
    scales[0] *= 1e4
    return {"many": many, "zero": zero, "scales": scales}


def block_errors(w, back, blocksize):
    f, b = w.reshape(-1).float(), back.reshape(-1).float()
    return [float((b[s:s + blocksize] - f[s:s + blocksize]).norm() / f[s:s + blocksize].norm())
            for s in range(0, f.numel(), blocksize)]


def probe_nf4(ns: dict) -> dict:
    inputs = many_blocks()
    return {"many": [my_nf4(ns, w, bs) for w, bs in inputs["many"]], "zero": my_nf4(ns, inputs["zero"]),
            "scales": my_nf4(ns, inputs["scales"])}


def judge_nf4(got: dict) -> str:
    inputs = many_blocks()
    for mine in got["many"] + [got["zero"], got["scales"]]:
        for key in ("codes", "absmax", "back"):
            is_tensor(mine[key], key)
    for (w, bs), mine in zip(inputs["many"], got["many"]):
        codes, absmax, back = mine["codes"], mine["absmax"], mine["back"]
        want = torch.stack([w.reshape(-1)[s:s + bs].abs().max() for s in range(0, w.numel(), bs)])
        assert absmax.shape == want.shape and torch.allclose(absmax.float(), want), \
            f"one absmax per block of {bs} (the last one shorter): expected shape {tuple(want.shape)}, got {tuple(absmax.shape)}"
        assert codes.numel() == w.numel() and tuple(back.shape) == tuple(w.shape)
        assert max(block_errors(w, back, bs)) < 0.2, block_errors(w, back, bs)
    codes, absmax, back = got["zero"]["codes"], got["zero"]["absmax"], got["zero"]["back"]
    assert absmax[1] == 0 and bool((codes.reshape(3, 64)[1] == 7).all()), "an all-zero block: absmax 0, and index 7 everywhere"
    assert torch.isfinite(back).all() and bool((back[1] == 0).all()), "an all-zero block comes back as zeros, not nan"
    assert max(block_errors(inputs["scales"], got["scales"]["back"], 64)) < 0.2, \
        "each block has its own scale: huge values must not ruin a block of small ones"
    return "many blocks and a shorter last one, blocksize 128, an all-zero block, and blocks of very different scales"


register("test_nf4_quantize_hidden", probe_nf4, judge_nf4)
