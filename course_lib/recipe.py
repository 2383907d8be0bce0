"""The fine-tune recipe: what makes a Llama fine-tune fast and lean on this hardware, and its memory plan.

``recipe_for(device)`` turns on, where the hardware has it:

- bf16 autocast with fp32 master weights: the matmuls run in bf16, the optimizer updates fp32
  weights (notebook 01), on a GPU or a CPU with bf16 kernels (``device.bf16_is_native``; an AVX2 CPU
  would only emulate them, several times slower than fp32, so there both recipe and baseline stay in
  fp32). Frozen weights (the base model under LoRA) are *stored* in bf16:
  autocast would cast them to bf16 for every matmul anyway, so this changes no number and halves
  their memory and the cast traffic;
- a fused AdamW (one kernel for the whole update instead of a loop of small ones);
- attention on a fused SDPA kernel in every dtype (``course_lib.attention``; transformers' default
  "sdpa" may fall back to the math kernel silently, in fp32 on GPUs);
- ``torch.compile`` of every decoder layer ("regional" compilation: one layer compiles once and
  is reused 16 or 32 times), on GPUs; on a CPU the compile time outweighs the gain;
- the chunked loss (``course_lib.loss.lm_loss``), which never builds the whole batch's fp32 logits;
- activation checkpointing only when memory needs it, and a micro-batch that fits: both chosen
  by ``plan_micro_batch`` from the device's memory and ``course_lib.memory``'s estimates.

``BASELINE`` is what a plain script does: ``LlamaForCausalLM(..., labels=labels).loss``,
``torch.optim.AdamW`` with default settings, bf16 autocast over fp32 trainable weights, no compile,
transformers' default attention (which is SDPA too: "sdpa" since transformers 4.36). Under LoRA
its frozen base linear weights are stored in bf16, as in a plain LoRA script that loads the base
with ``dtype=torch.bfloat16`` (peft then keeps the adapters in fp32): a baseline with an fp32 base
would pay twice the memory and weight traffic no user pays, and flatter the recipe. So under LoRA
the recipe's gains are the ones a user does not already have: the fused optimizer, the compiled
layers, the chunked loss, a fused attention kernel guaranteed, and the memory plan. A recipe goes
into the course's one step as
``train_step(model, optimizer, batch, loss_fn=recipe.loss, amp_dtype=recipe.amp_dtype)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from course_lib import attention
from course_lib.checkpointing import checkpoint_layers, transformer_layers
from course_lib.device import bf16_is_native, default_device, device_held_bytes, device_memory_bytes
from course_lib.loss import LOSS_CHUNK_TOKENS, forward_loss, lm_loss
from course_lib.memory import estimate_model_state, llama_activation_bytes
from course_lib.models import llama_num_parameters, unwrap_causal_lm


@dataclass(frozen=True)
class Recipe:
    """How a fine-tune runs: which of the speed and memory techniques are on."""

    name: str = "recipe"
    amp_dtype: torch.dtype = torch.bfloat16
    fused_optimizer: bool = True
    attn_implementation: str | None = attention.IMPLEMENTATION
    compile: bool = False
    chunked_loss: bool = True
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    frozen_weights_bf16: bool = True
    checkpointing: bool = False

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The recipe's loss of a dict batch: chunked (fused by ``torch.compile`` when compiling), or plain."""
        if not self.chunked_loss:
            return forward_loss(model, batch)
        return lm_loss(model, batch, chunk_tokens=self.loss_chunk_tokens, fused=self.compile)


# frozen_weights_bf16: a plain LoRA script loads its frozen base in bf16 (it changes nothing under full fine-tune,
# where no weight is frozen)
BASELINE = Recipe(name="baseline", amp_dtype=torch.bfloat16, fused_optimizer=False, attn_implementation=None,
                  compile=False, chunked_loss=False, frozen_weights_bf16=True, checkpointing=False)


def recipe_for(device: torch.device | str, *, compile: bool | None = None, checkpointing: bool = False) -> Recipe:
    """The recipe for ``device``: everything on, except ``torch.compile`` on a CPU (compiling costs
    more than a short CPU run gains); pass ``compile=True`` to force it."""
    device = torch.device(device)
    if compile is None:
        compile = device.type == "cuda"
    return Recipe(compile=compile, checkpointing=checkpointing, amp_dtype=amp_dtype_for(device))


def baseline_for(device: torch.device | str) -> Recipe:
    """``BASELINE`` on ``device``: the plain script's choices, in the matmul dtype the device runs natively (the
    dtype is the hardware's, not a gain of the recipe's)."""
    return replace(BASELINE, amp_dtype=amp_dtype_for(device))


def amp_dtype_for(device: torch.device | str) -> torch.dtype:
    """bf16 where ``device`` has bf16 matmuls in hardware, else fp32 (autocast to an emulated bf16 only costs time)."""
    return torch.bfloat16 if bf16_is_native(device) else torch.float32


def _fused_adamw_available(device: torch.device) -> bool:
    try:
        p = nn.Parameter(torch.zeros(1, device=device))
        torch.optim.AdamW([p], fused=True)
        return True
    except (RuntimeError, TypeError):
        return False


def make_optimizer(model: nn.Module, recipe: Recipe = BASELINE, lr: float = 1e-4, weight_decay: float = 0.0):
    """AdamW over the trainable parameters: fused where the recipe asks and the device has it."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    if recipe.fused_optimizer and _fused_adamw_available(device):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def prepare(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Apply the recipe's model-side choices in place: bf16 storage of frozen linear weights,
    attention implementation, activation checkpointing, regional ``torch.compile``."""
    lm = unwrap_causal_lm(model)
    if recipe.attn_implementation is not None:
        attention.register()
        lm.config._attn_implementation = recipe.attn_implementation
    if recipe.frozen_weights_bf16 and recipe.amp_dtype == torch.bfloat16:
        tied = lm.get_input_embeddings().weight
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad and module.weight is not tied:
                module.weight.data = module.weight.data.to(torch.bfloat16)
    if recipe.checkpointing:  # notebook 04's whole-block checkpointing, before compile so each compiled layer holds it
        checkpoint_layers(transformer_layers(lm))
    if recipe.compile:
        for layer in lm.model.layers:
            layer.compile()
    return model


# ------------------------------------------------------------------------------ memory planning
def estimate_step_bytes(config, seq_len: int, micro_batch: int, *, lora: bool = False, checkpointing: bool = False,
                        chunked_loss: bool = True, frozen_bytes: int = 2, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                        lora_params: int = 0, trainable_head: bool | None = None) -> dict[str, int]:
    """Bytes one training step needs, from ``course_lib.memory``'s estimates.

    Model state: full fine-tune, fp32 weights, gradients and AdamW's two states (16 bytes per
    parameter); LoRA, the frozen base at ``frozen_bytes`` per parameter plus 16 per adapter
    parameter. Activations: ``llama_activation_bytes`` in bf16, and the logits as the loss keeps
    them: the chunked loss one chunk's (fp32 and bf16) and the hidden states' gradient; the plain
    loss bf16 logits, their fp32 copy and its gradient (about 10 bytes per vocabulary entry and token).

    "lm head gradient": the chunked loss computes the LM head's weight gradient in its forward
    and keeps it, fp32 V×d, alive through the whole backward, on top of the gradient the model
    state counts (2 GiB at 8B: 128256 × 4096 × 4 bytes). Only where the head trains:
    ``trainable_head`` defaults to full fine-tune; LoRA (peft) freezes the head with the base.
    """
    n = llama_num_parameters(config)
    if lora:
        state = n * frozen_bytes + 16 * lora_params
    else:
        state = estimate_model_state(n, "float32", "adamw")["total"]
    tokens = micro_batch * seq_len
    # the logits are counted below, as this loss keeps them; with checkpointing, one layer is recomputed at a time
    acts = llama_activation_bytes(config, micro_batch, seq_len, dtype_bytes=2, checkpointed=checkpointing,
                                  logits_bytes=0, recomputing=True)
    if chunked_loss:
        logits = min(tokens, chunk_tokens) * config.vocab_size * (4 + 2) + tokens * config.hidden_size * 4
    else:
        logits = tokens * config.vocab_size * (2 + 4 + 4)
    trainable_head = not lora if trainable_head is None else trainable_head
    head_grad = config.vocab_size * config.hidden_size * 4 if chunked_loss and trainable_head else 0
    return {"model state": state, "activations": acts, "logits": logits, "lm head gradient": head_grad,
            "total": state + acts + logits + head_grad}


def plan_micro_batch(config, seq_len: int, device: torch.device | str | None = None, *, micro_batch: int | None = None,
                     lora: bool = False, chunked_loss: bool = True, frozen_bytes: int = 2, max_micro_batch: int = 16,
                     memory_bytes: int | None = None, headroom: float = 0.85, cpu_micro_batch: int = 8,
                     lora_params: int = 0, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                     held_bytes: int | None = None) -> dict:
    """Choose the micro-batch and whether to checkpoint, from the device's memory.

    With ``micro_batch`` given (the batch you want per step): that size without checkpointing if
    it fits in ``headroom`` × the memory; else with checkpointing; else the largest size that fits
    with checkpointing, and gradient accumulation to make up the rest. With ``micro_batch=None``:
    the largest power of two up to ``max_micro_batch`` that fits without checkpointing, and
    checkpointing only when not even 1 fits. On a CPU (no ``memory_bytes`` given) the plan is a
    fixed small one: CPU RAM is not the limit there, time is.

    On the GPU in hand (no ``memory_bytes`` given) what this process's live tensors hold already (the models of
    earlier notebook cells) comes off the budget (``held_bytes``, measured by ``device_held_bytes`` unless given):
    a plan that ignored it chose sizes that ran out of memory.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda" and memory_bytes is None:
        mb = micro_batch or cpu_micro_batch
        return {"micro_batch": mb, "accum_steps": 1, "checkpointing": False, "estimated_bytes": None,
                "budget_bytes": None, "reason": "CPU: a fixed small plan (time, not memory, is the limit)"}
    if held_bytes is None:
        held_bytes = 0 if memory_bytes is not None else device_held_bytes(device)
    budget = headroom * (memory_bytes or device_memory_bytes(device)) - held_bytes
    kw = dict(lora=lora, chunked_loss=chunked_loss, frozen_bytes=frozen_bytes, lora_params=lora_params,
              chunk_tokens=chunk_tokens)

    def need(mb: int, ckpt: bool) -> int:
        return estimate_step_bytes(config, seq_len, mb, checkpointing=ckpt, **kw)["total"]

    def plan(mb, ckpt, accum, reason):
        return {"micro_batch": mb, "accum_steps": accum, "checkpointing": ckpt, "estimated_bytes": need(mb, ckpt),
                "budget_bytes": int(budget), "held_bytes": held_bytes, "reason": reason}

    if micro_batch is not None:
        if need(micro_batch, False) <= budget:
            return plan(micro_batch, False, 1, "fits without checkpointing")
        if need(micro_batch, True) <= budget:
            return plan(micro_batch, True, 1, "fits only with activation checkpointing")
        target = micro_batch
    else:
        sizes = [2**i for i in range(int(math.log2(max_micro_batch)), -1, -1)]
        for mb in sizes:
            if need(mb, False) <= budget:
                return plan(mb, False, 1, "largest micro-batch without checkpointing")
        target = 1
    for mb in [2**i for i in range(int(math.log2(max(target, 1))), -1, -1)]:
        if need(mb, True) <= budget:
            accum = math.ceil(target / mb)
            return plan(mb, True, accum, "checkpointing, and accumulation for the rest of the batch")
    held = (f" after the {held_bytes / 2**30:.1f} GiB held already (free the models of earlier cells: del them, then "
            "course_lib.device.free_memory())") if held_bytes else ""
    raise ValueError(f"even micro-batch 1 with checkpointing needs {need(1, True) / 2**30:.1f} GiB and the budget "
                     f"is {budget / 2**30:.1f} GiB{held}: use LoRA, a shorter sequence, "
                     "or shard the model (FSDP, ZeRO-3)")
