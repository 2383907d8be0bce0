"""Notebook 11's visible tests: the response labels, the LoRA layer (one layer and a tiny Llama) and the LoRA count."""

from __future__ import annotations

import copy
import math

import torch

from course_lib import lora, qlora  # noqa: F401  qlora first: it quiets the bitsandbytes log line importing peft can write
import peft
from peft.tuners.lora import Linear as PeftLinear, LoraLayer as PeftLoraLayer
from course_grader.checks import number, register
from course_grader.grading import forbid
from course_lib.apps.finetune import load_tokenizer
from course_lib.instruct import (IGNORE_INDEX, example_texts, load_instruction_data, pack_examples, pad_batch,
                                 tokenize_example)
from course_lib.lora import ALL_LINEAR, add_lora, apply_lora, copy_adapters, lora_linear, trainable_parameters
from course_lib.models import build_llama, llama_config

# What each exercise builds, out of reach while the student's code runs.
LABELLING = (tokenize_example, pad_batch, pack_examples)
PEFT = (PeftLinear, PeftLoraLayer, peft.get_peft_model, lora.lora_linear, lora.apply_lora)
COUNTS = (lora.lora_trainable_parameters, lora.linear_shapes)


def tensor(x):
    """A tensor the student's code returned, as data (detached, on the CPU); anything else as its ``repr``."""
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else repr(x)[:200]


def is_tensor(x, what: str) -> None:
    assert isinstance(x, torch.Tensor), f"{what}: return a tensor, not {x}"


# ---------------------------------------------------------------- response_labels
def labelling_batch() -> tuple[dict, list[int], list[int]]:
    """A padded batch of the first six training examples of the notebook's data, as the graded run makes them
    (seed 0, the smoke tier's sizes, the package's own data and tokenizer), its prompt lengths and lengths."""
    data = load_instruction_data(None, task="reverse", n_train=200, n_test=16, seed=0)
    base_data = load_instruction_data(None, task="sort", n_train=200, n_test=16, seed=7)
    tok = load_tokenizer(None, example_texts(data["train"] + base_data["train"]), vocab_size=384)
    feats = [tokenize_example(tok, e) for e in data["train"][:6]]
    return (pad_batch(feats, tok.pad_token_id), [f["labels"].count(IGNORE_INDEX) for f in feats],
            [len(f["input_ids"]) for f in feats])


def student_labels(ns: dict) -> dict:
    """The student's labels of the batch, and the batch's input_ids after the call."""
    batch, plen, lens = labelling_batch()
    with forbid(*LABELLING, namespace=ns):
        labels = ns["response_labels"](batch["input_ids"], plen, lens)
    return {"labels": tensor(labels), "input_ids after": batch["input_ids"].clone()}


def judge_labels(got: dict) -> str:
    batch, plen, lens = labelling_batch()
    labels = got["labels"]
    assert torch.equal(got["input_ids after"], batch["input_ids"]), "input_ids was modified: return a new tensor"
    is_tensor(labels, "labels")
    assert labels.shape == batch["input_ids"].shape, f"expected shape {tuple(batch['input_ids'].shape)}"
    resp = torch.zeros_like(batch["labels"], dtype=torch.bool)
    for i, (p, n) in enumerate(zip(plen, lens)):
        resp[i, p:n] = True
    assert torch.equal(labels[resp], batch["labels"][resp]), "response tokens must keep their ids as labels"
    assert bool((labels[:, :min(plen)] == IGNORE_INDEX).all()), "prompt positions must be -100"
    return "prompt masked, response kept"


register("test_response_labels", student_labels, judge_labels)


# ---------------------------------------------------------------- LoRALinear
def base_layer(in_features: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, 12)


def adapters_and_input(r: int, shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The A (r x in) and B (12 x r) both layers get, and the input, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(r, shape[-1], generator=g) * 0.3, torch.randn(12, r, generator=g) * 0.3
    return a, b, torch.randn(*shape, generator=g)


def my_pair(ns: dict, r: int, alpha: float, dropout: float = 0.0, shape=(5, 16), seed: int = 0):
    """The student's layer on a copy of the base layer, with the chosen A and B, and the input."""
    base = base_layer(shape[-1], seed)
    with forbid(*PEFT, namespace=ns):
        mine = ns["LoRALinear"](copy.deepcopy(base), r, alpha, dropout)
    a, b, x = adapters_and_input(r, shape, seed)
    mine.lora_A.weight.data.copy_(a)
    mine.lora_B.weight.data.copy_(b)
    return mine, x


def their_pair(r: int, alpha: float, dropout: float = 0.0, shape=(5, 16), seed: int = 0):
    """peft's layer on a copy of the same base layer, with the same A and B, the base layer and the input."""
    base = base_layer(shape[-1], seed)
    theirs = lora_linear(copy.deepcopy(base), r, alpha, dropout)
    a, b, x = adapters_and_input(r, shape, seed)
    theirs.lora_A["default"].weight.data.copy_(a)
    theirs.lora_B["default"].weight.data.copy_(b)
    return base, theirs, x


def fresh_input() -> torch.Tensor:
    return torch.randn(5, 16, generator=torch.Generator().manual_seed(0))


def probe_layer(ns: dict) -> dict:
    base0 = base_layer(16, 0)
    with forbid(*PEFT, namespace=ns):
        fresh = ns["LoRALinear"](copy.deepcopy(base0), 4, 8)
        out = {"trainable": {n: list(p.shape) for n, p in fresh.named_parameters() if p.requires_grad},
               "A": tensor(fresh.lora_A.weight), "B": tensor(fresh.lora_B.weight),
               "fresh y": tensor(fresh(fresh_input()))}
    mine, x = my_pair(ns, 4, 8)
    with forbid(*PEFT, namespace=ns):
        y = mine(x)
        y.sum().backward()
    return {**out, "y": tensor(y), "A grad": tensor(mine.lora_A.weight.grad)}


def judge_layer(got: dict) -> str:
    trainable = {n: tuple(s) for n, s in got["trainable"].items()}
    assert trainable == {"lora_A.weight": (4, 16), "lora_B.weight": (12, 4)}, \
        f"only lora_A (r x in) and lora_B (out x r) train; trainable here: {trainable}"
    is_tensor(got["B"], "lora_B.weight")
    assert (got["B"] == 0).all(), "lora_B starts at zero, so the adapted layer starts as the base layer"
    bound = 1 / math.sqrt(16)  # kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    is_tensor(got["A"], "lora_A.weight")
    assert got["A"].abs().max() <= bound and got["A"].std() > 0.6 * bound / math.sqrt(3), \
        "initialise lora_A with nn.init.kaiming_uniform_(weight, a=math.sqrt(5))"
    with torch.no_grad():
        base_y = base_layer(16, 0)(fresh_input())
    is_tensor(got["fresh y"], "the layer's output")
    assert torch.equal(got["fresh y"], base_y), "at the start (B = 0) the output must be the base layer's"

    _, theirs, x = their_pair(4, 8)
    y_ref = theirs(x)
    y_ref.sum().backward()
    is_tensor(got["y"], "the layer's output")
    assert torch.allclose(got["y"], y_ref, atol=1e-5), \
        f"output differs from peft's by {(got['y'] - y_ref).abs().max():.2e}: base(x) + lora_B(lora_A(x)) * alpha / r"
    assert isinstance(got["A grad"], torch.Tensor), \
        f"A's gradient differs from peft's: lora_A.weight.grad is {got['A grad']}"
    assert torch.allclose(got["A grad"], theirs.lora_A["default"].weight.grad, atol=1e-5), \
        "A's gradient differs from peft's"
    return "one layer: peft's outputs and gradients"


register("test_LoRALinear", probe_layer, judge_layer)


# ---------------------------------------------------------------- LoRALinear on a tiny Llama
def tiny_llamas():
    """A 2-layer tiny Llama and peft's LoRA (r=4, alpha=8, every linear layer) on a copy, its B random."""
    cfg = llama_config("tiny", num_hidden_layers=2)
    torch.manual_seed(0)
    llama = build_llama(cfg)
    torch.manual_seed(1)
    peft_llama = apply_lora(copy.deepcopy(llama), r=4, alpha=8, target_modules=ALL_LINEAR)
    for m in peft_llama.modules():
        if isinstance(m, PeftLinear):
            m.lora_B["default"].weight.data.normal_(0, 0.05)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return llama, peft_llama, ids


def probe_llama(ns: dict) -> dict:
    llama, peft_llama, ids = tiny_llamas()
    with forbid(*PEFT, namespace=ns):
        my_llama = copy_adapters(peft_llama, add_lora(copy.deepcopy(llama), ns["LoRALinear"], r=4, alpha=8,
                                                      target_modules=ALL_LINEAR))
    trainable = number(trainable_parameters(my_llama))
    with torch.no_grad(), forbid(*PEFT, namespace=ns):
        logits = my_llama(input_ids=ids).logits
    return {"trainable": trainable, "logits": tensor(logits)}


def judge_llama(got: dict) -> str:
    _, peft_llama, ids = tiny_llamas()
    assert got["trainable"] == trainable_parameters(peft_llama), \
        f"peft trains {trainable_parameters(peft_llama)} parameters, your layers {got['trainable']}"
    with torch.no_grad():
        ref = peft_llama(input_ids=ids).logits
    is_tensor(got["logits"], "the logits")
    assert torch.allclose(got["logits"], ref, atol=1e-4), \
        f"logits differ from peft's by {(got['logits'] - ref).abs().max():.2e}"
    return "tiny Llama: peft's trainable count and logits"


register("test_LoRALinear_llama", probe_llama, judge_llama)


# ---------------------------------------------------------------- lora_params
def small_config():
    return llama_config("tiny", num_hidden_layers=2)


def peft_count(r: int, targets) -> int:
    """What peft trains on the 2-layer tiny Llama, LoRA of rank ``r`` on ``targets``."""
    return trainable_parameters(apply_lora(build_llama(small_config()), r=r, target_modules=tuple(targets)))


def student_count(ns: dict, config, r: int, targets) -> int | float | str:
    with forbid(*COUNTS, namespace=ns):
        return number(ns["lora_params"](config, r, list(targets)))


def judge_count(got) -> str:
    want = peft_count(4, ("q_proj", "o_proj"))
    assert got == want, f"peft trains {want}, you counted {got}"
    return "matches peft"


register("test_lora_params", lambda ns: student_count(ns, small_config(), 4, ("q_proj", "o_proj")), judge_count)
