"""Notebook 11's hidden tests (instructor edition only): padding and a pad id equal to EOS, merge and dropout against
peft's layer, the LoRA count on other layers and Llama-3.1-8B."""

from __future__ import annotations

import torch

from course_grader.checks import case_seed, register
from course_grader.checks.nb11 import (LABELLING, PEFT, is_tensor, labelling_batch, my_pair, peft_count, small_config,
                                    student_count, student_labels, tensor, their_pair)
from course_grader.grading import forbid
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
MERGE = dict(r=8, alpha=4, shape=(2, 3, 16))  # scaling 0.5, a (batch, seq, in) input
DROPOUT = dict(r=4, alpha=8, dropout=0.5)


def seeded(case: dict, name: str) -> dict:
    """``case`` with its weights' and input's seed: new to every grading (``case_seed``)."""
    return {**case, "seed": case_seed("lora", name)}


def probe_merge(ns: dict) -> dict:
    mine, x = my_pair(ns, **seeded(MERGE, "merge"))
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
    mine, x = my_pair(ns, **seeded(DROPOUT, "dropout"))
    mine.train()
    with forbid(*PEFT, namespace=ns):
        torch.manual_seed(case_seed("lora", "mask"))
        out["y dropout"] = tensor(mine(x))
    return out


def judge_merge(got: dict) -> str:
    base, theirs, x = their_pair(**seeded(MERGE, "merge"))
    with torch.no_grad():
        y_ref = theirs(x)
        for key in ("y", "w merged", "w merged twice", "y merged", "w unmerged", "y unmerged"):
            is_tensor(got[key], key)
        y = got["y"]
        assert torch.allclose(y, y_ref, atol=1e-5), "r=8, alpha=4: the update is scaled by alpha / r = 0.5"
        assert torch.equal(got["w merged twice"], got["w merged"]), "merging twice must not add the update twice"
        assert got["merged"] and torch.allclose(got["y merged"], y, atol=1e-5), \
            "the merged layer computes the same outputs"
        theirs.merge()
        assert torch.allclose(got["w merged"], theirs.base_layer.weight, atol=1e-6), \
            "merge: W + (alpha / r) * B @ A, as peft's"
        assert not got["merged after unmerge"] and torch.allclose(got["w unmerged"], base.weight, atol=1e-6), \
            "unmerge restores W"
        assert torch.allclose(got["y unmerged"], y, atol=1e-5)
    _, theirs, x = their_pair(**seeded(DROPOUT, "dropout"))
    theirs.train()
    torch.manual_seed(case_seed("lora", "mask"))
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
    assert len(got["tiny"]) == len(TARGETS), f"{len(got['tiny'])} counts for the {len(TARGETS)} cases"
    for (targets, r), n in zip(TARGETS, got["tiny"]):
        want = peft_count(r, targets)
        assert n == want, f"LoRA of rank {r} on {', '.join(targets)}: peft trains {want}, you counted {n}"
    assert got["8b"] == 41_943_040
    return "k_proj and v_proj under grouped-query attention, the MLP, other ranks, and Llama-3.1-8B"


register("test_lora_params_hidden", probe_count, judge_count)
