"""LoRA: train a low-rank update ``B·A`` beside each frozen weight, through peft.

An adapted linear layer computes ``W x + (alpha / r) · B (A x)`` with ``W`` frozen, ``A`` (r × in)
and ``B`` (out × r) trained. ``B`` starts at zero, so the wrapped model computes exactly what the
base model does until the first update. Per adapted layer that is ``r · (in + out)`` trainable
parameters instead of ``in · out``: for Llama-3.1-8B with r = 16 on every linear layer, 42M of 8B.
After training, the adapters are saved alone (megabytes), put back on the same base weights,
or merged into them (``W + (alpha/r)·B·A``): a plain model with no extra latency.

The layer itself is peft's (``lora_linear`` is the reference notebook 11's ``LoRALinear`` is compared
with); the count from a config (``lora_trainable_parameters``) is notebook 11's exercise, a stub in the
student edition. A layer of your own goes on a whole model with ``add_lora``; ``same_start`` gives it
peft's very adapters, so that notebook 11's ``LoRALinear`` and notebook 12's ``QLoRALinear`` train
from the start peft's LoRA trains from.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch import nn

from course_lib.models import count_parameters

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(model: nn.Module, r: int = 8, alpha: int = 16, target_modules=LORA_TARGETS, dropout: float = 0.0):
    """Wrap ``model`` with LoRA adapters (peft's ``get_peft_model``): base weights frozen, ``A`` and ``B`` trained."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout,
                        bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def lora_linear(base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> nn.Module:
    """peft's LoRA layer around one ``nn.Linear``, the base frozen: the reference a LoRA layer of your own
    is compared with (its adapters are ``lora_A["default"]`` and ``lora_B["default"]``)."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear

    layer = Linear(base, "default", LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout), r=r, lora_alpha=alpha,
                   lora_dropout=dropout)
    base.requires_grad_(False)
    return layer


def add_lora(model: nn.Module, layer, r: int, alpha: float, target_modules=LORA_TARGETS,
             dropout: float = 0.0) -> nn.Module:
    """Freeze ``model`` and put ``layer(child, r, alpha, dropout)`` (a LoRA layer of your own: notebook 11's
    ``LoRALinear``, notebook 12's ``QLoRALinear``) in place of every ``nn.Linear`` named in ``target_modules``."""
    model.requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in target_modules and isinstance(child, nn.Linear):
                setattr(parent, name, layer(child, r, alpha, dropout))
    return model


def copy_adapters(peft_model: nn.Module, model: nn.Module) -> nn.Module:
    """Give ``model``'s LoRA layers (``lora_A``, ``lora_B``: ``nn.Linear``) the A and B of ``peft_model``, a peft
    model of the same base."""
    for name, module in peft_model.named_modules():
        if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and "default" in module.lora_A:
            mine = model.get_submodule(name.removeprefix("base_model.model."))
            mine.lora_A.weight.data.copy_(module.lora_A["default"].weight)
            mine.lora_B.weight.data.copy_(module.lora_B["default"].weight)
    return model


def same_start(model: nn.Module, layer=None, *, r: int = 8, alpha: float = 16, target_modules=ALL_LINEAR,
               seed: int = 0) -> nn.Module:
    """LoRA from a start that does not depend on who wrote the layer: peft's adapters, A drawn after
    ``torch.manual_seed(seed)`` and B = 0; with ``layer``, that layer of your own on every target of ``model``,
    holding the very same A and B. Two fine-tunes from ``same_start`` differ only in the layer."""
    if layer is None:
        torch.manual_seed(seed)
        return apply_lora(model, r=r, alpha=alpha, target_modules=target_modules)
    device = next(model.parameters()).device
    reference = same_start(copy.deepcopy(model), r=r, alpha=alpha, target_modules=target_modules, seed=seed)
    return copy_adapters(reference, add_lora(model, layer, r, alpha, target_modules)).to(device)


# graded: 11_llama_finetune lora_params
def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of a Llama block, from its config."""
    d, ffn = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}


# graded: 11_llama_finetune lora_params
def lora_trainable_parameters(config, r: int, target_modules=LORA_TARGETS) -> int:
    """LoRA's trainable parameters from the config alone: r·(in + out) per adapted linear, every layer."""
    shapes = linear_shapes(config)
    return config.num_hidden_layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules)


def trainable_parameters(model: nn.Module) -> int:
    """Parameters with ``requires_grad`` (each shared tensor counted once)."""
    return count_parameters(model, trainable_only=True)


def save_adapters(model: nn.Module, path: str | Path) -> int:
    """Save only the LoRA adapters (``save_pretrained`` of a PEFT model); returns the bytes written."""
    path = Path(path)
    model.save_pretrained(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load_adapters(base_model: nn.Module, path: str | Path, trainable: bool = False) -> nn.Module:
    """Put saved adapters back on a base model with the same weights (``PeftModel.from_pretrained``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold ``W + (alpha/r)·B·A`` into each base weight and drop the adapters: a plain model, no extra latency."""
    return model.merge_and_unload()
