"""Fine-tuning a Llama: one code path for every tier, LoRA or full, the recipe and the baseline.

    model = load_model(None, preset="tiny")                 # or a Hugging Face name: from_pretrained
    model = apply_lora(model, r=8)                          # or leave it for a full fine-tune
    recipe = recipe_for(device)                             # what makes training fast and lean here
    model = prepare(model, recipe)
    optimizer = make_optimizer(model, recipe, lr=1e-3)
    history = finetune(model, optimizer, batch_iter, steps=100, recipe=recipe)

**The recipe** (``recipe_for``), each part where the hardware has it:

- bf16 autocast with fp32 master weights: the matmuls run in bf16, the optimizer updates fp32
  weights (notebook 01). Frozen weights (the base model under LoRA) are *stored* in bf16:
  autocast would cast them to bf16 for every matmul anyway, so this changes no number and halves
  their memory and the cast traffic.
- a fused AdamW (one kernel for the whole update instead of a loop of small ones);
- SDPA attention (flash or memory-efficient kernels);
- ``torch.compile`` of every decoder layer ("regional" compilation: one layer compiles once and
  is reused 16 or 32 times), on GPUs; on a CPU the compile time outweighs the gain;
- a loss that never materialises the fp32 logits of the whole batch (``chunked_lm_loss``): with
  a 128k vocabulary, batch 4 and 2048 tokens, those logits alone are 4 GiB in fp32, plus as much
  again for their gradient. The LM head and the cross-entropy run chunk by chunk over tokens,
  and the gradients of each chunk are computed at once, so only one chunk's logits ever exist;
- activation checkpointing only when memory needs it, and a micro-batch that fits: both chosen
  by ``plan_micro_batch`` from the device's memory and ``course_lib.memory``'s estimates.

**The baseline** (``BASELINE``) is what a plain script does: ``LlamaForCausalLM(...,
labels=labels).loss``, ``torch.optim.AdamW`` with default settings, bf16 autocast over fp32
weights, no compile, transformers' default attention. ``course_lib.benchmark`` runs both.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import accelerate_configs
from course_lib.instruct import IGNORE_INDEX, format_prompt, packed_attention_mask
from course_lib.precision import autocast
from course_lib.train import check_accumulation

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------------------- models
def load_model(model_name: str | None = None, *, preset: str = "tiny", dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str | None = "sdpa", seed: int = 0,
               **overrides) -> nn.Module:
    """A ``LlamaForCausalLM``: random weights from ``preset`` when ``model_name`` is None, else
    ``AutoModelForCausalLM.from_pretrained(model_name)`` (real weights, if you have them).

    ``attn_implementation=None`` keeps transformers' default.
    """
    if model_name is None:
        from course_lib.models import build_llama, llama_config

        config = llama_config(preset, **overrides)
        return build_llama(config, dtype=dtype, device=device, attn_implementation=attn_implementation, seed=seed)
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, **overrides}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_name, **kwargs).to(device)
    model.config.use_cache = False
    return model


def load_tokenizer(model_name: str | None = None, texts: list[str] | None = None, vocab_size: int = 512):
    """The model's own tokenizer (``AutoTokenizer.from_pretrained``), or, with ``model_name=None``,
    a byte-level BPE the package trains on ``texts`` in about a second."""
    if model_name is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_name)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    from course_lib.data import train_tokenizer

    if not texts:
        raise ValueError("texts is needed to train a tokenizer when model_name is None")
    return train_tokenizer("\n".join(texts), vocab_size=vocab_size)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ----------------------------------------------------------------------------------------- LoRA
def apply_lora(model: nn.Module, r: int = 8, alpha: int = 16, target_modules=LORA_TARGETS, dropout: float = 0.0):
    """Wrap ``model`` with LoRA adapters (peft): base weights frozen, ``A`` (r×in) and ``B`` (out×r) trained.

    ``B`` starts at zero, so the wrapped model computes exactly what the base model does until
    the first update; the adapter's output is scaled by ``alpha / r``.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout,
                        bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of a Llama block, from its config."""
    d, ffn = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}


def lora_trainable_parameters(config, r: int, target_modules=LORA_TARGETS) -> int:
    """LoRA's trainable parameters from the config alone: r·(in + out) per adapted linear, every layer."""
    shapes = linear_shapes(config)
    return config.num_hidden_layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules)


def trainable_parameters(model: nn.Module) -> int:
    """Parameters with ``requires_grad`` (each shared tensor counted once)."""
    from course_lib.models import count_parameters

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


# --------------------------------------------------------------------------------------- recipe
@dataclass(frozen=True)
class Recipe:
    """How a fine-tune runs: which of the speed and memory techniques are on."""

    name: str = "recipe"
    amp_dtype: torch.dtype = torch.bfloat16
    fused_optimizer: bool = True
    attn_implementation: str | None = "sdpa"
    compile: bool = False
    chunked_loss: bool = True
    loss_chunk_tokens: int = 4096
    frozen_weights_bf16: bool = True
    checkpointing: bool = False


BASELINE = Recipe(name="baseline", amp_dtype=torch.bfloat16, fused_optimizer=False, attn_implementation=None,
                  compile=False, chunked_loss=False, frozen_weights_bf16=False, checkpointing=False)


def recipe_for(device: torch.device | str, *, compile: bool | None = None, checkpointing: bool = False) -> Recipe:
    """The recipe for ``device``: everything on, except ``torch.compile`` on a CPU (compiling costs
    more than a short CPU run gains); pass ``compile=True`` to force it."""
    device = torch.device(device)
    if compile is None:
        compile = device.type == "cuda"
    return Recipe(compile=compile, checkpointing=checkpointing)


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
    lm = _causal_lm(model)
    if recipe.attn_implementation is not None:
        lm.config._attn_implementation = recipe.attn_implementation
    if recipe.frozen_weights_bf16 and recipe.amp_dtype == torch.bfloat16:
        tied = lm.get_input_embeddings().weight
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad and module.weight is not tied:
                module.weight.data = module.weight.data.to(torch.bfloat16)
    if recipe.checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.compile:
        for layer in lm.model.layers:
            layer.compile()
    return model


# ----------------------------------------------------------------------------------------- loss
def _ce_chunk_eager(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """Per-row loss and d loss / d logits (in the logits' dtype) for one chunk, in place where it can."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    rows = lse - x.gather(1, targets[:, None]).squeeze(1)
    probs = x.sub_(lse[:, None]).exp_()
    probs[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    return rows, probs.mul_(scale[:, None]).to(logits.dtype)


def _ce_chunk_fusable(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """``_ce_chunk_eager`` written without in-place ops, for ``torch.compile`` to fuse into one pass
    over the chunk's logits (the eager version makes about ten passes over fp32 values)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    rows = lse - x.gather(1, targets[:, None]).squeeze(1)
    iota = torch.arange(x.shape[-1], device=x.device)
    p = torch.exp(x - lse[:, None])
    g = torch.where(iota[None, :] == targets[:, None], p - 1.0, p) * scale[:, None]
    return rows, g.to(logits.dtype)


_CE_COMPILED = None


def _ce_chunk_compiled():
    global _CE_COMPILED
    if _CE_COMPILED is None:
        _CE_COMPILED = torch.compile(_ce_chunk_fusable)
    return _CE_COMPILED


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, chunk by chunk over tokens.

    Forward computes, per chunk, the logits (in ``compute_dtype``, upcast to fp32 for the
    softmax), the loss, and right away the gradients with respect to the chunk's hidden states
    and to the weight; only those gradients are kept, never the logits. Backward just scales
    them by the incoming gradient. Same three matmuls per chunk as the unchunked loss.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, compute_dtype, fused):
        n_valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ce = _ce_chunk_compiled() if fused else _ce_chunk_eager
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.shape[0], chunk_tokens):
                h = hidden[s:s + chunk_tokens].to(compute_dtype)
                t = targets[s:s + chunk_tokens]
                valid = t != IGNORE_INDEX
                logits = h @ w.t()
                if not (need_h or need_w):
                    lse = torch.logsumexp(logits.float(), dim=-1)
                    rows = lse - logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1).float()
                    total += (rows * valid).sum()
                    continue
                # d loss / d logits = (softmax - onehot) / n_valid, on valid rows only
                rows, g = ce(logits, t.clamp(min=0), valid.float() / n_valid)
                del logits
                total += (rows * valid).sum()
                if need_h:
                    grad_h[s:s + chunk_tokens] = (g @ w).to(hidden.dtype)
                if need_w:
                    gw = (g.t() @ h).float()
                    grad_w = gw if grad_w is None else grad_w.add_(gw)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (need_h, need_w)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        grad_h = saved.pop(0) * grad_out if need_h else None
        grad_w = (saved.pop(0) * grad_out) if need_w else None
        return grad_h, grad_w, None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 2048,
                    compute_dtype: torch.dtype | None = None, fused: bool = False) -> torch.Tensor:
    """Next-token cross-entropy from the last hidden states, without the whole batch's logits.

    ``hidden`` is (batch, T, d), ``weight`` the LM head's (V, d), ``labels`` (batch, T) in the
    transformers convention (``labels[t]`` is the token at ``t``; -100 is ignored). Equals
    ``LlamaForCausalLM(..., labels=labels).loss`` and has the same gradients; its largest
    temporary is ``chunk_tokens × V`` fp32 values instead of ``batch × T × V``.
    ``compute_dtype`` is the matmul dtype: the autocast dtype if autocast is on, else the weight's.
    ``fused=True`` compiles the softmax-and-gradient part of each chunk into one kernel.
    """
    if compute_dtype is None:
        compute_dtype = (torch.get_autocast_dtype(hidden.device.type)
                         if torch.is_autocast_enabled(hidden.device.type) else weight.dtype)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # position t predicts token t+1
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets, chunk_tokens,
                                            compute_dtype, fused)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], recipe: Recipe = BASELINE) -> torch.Tensor:
    """The mean next-token loss of a batch on the response tokens: the recipe's chunked loss from the
    decoder's hidden states, or the baseline's ``model(..., labels=labels).loss``."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    if "document_ids" in batch:  # packed rows: keep documents apart
        inputs["attention_mask"] = packed_attention_mask(batch["document_ids"])
    if not recipe.chunked_loss:
        return model(**inputs, labels=batch["labels"]).loss
    lm = _causal_lm(model)
    hidden = lm.model(**inputs).last_hidden_state
    return chunked_lm_loss(hidden, lm.lm_head.weight, batch["labels"], chunk_tokens=recipe.loss_chunk_tokens,
                           fused=recipe.compile)


# ------------------------------------------------------------------------------------- training
def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def finetune_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                  recipe: Recipe = BASELINE, accum_steps: int = 1, clip_norm: float | None = None) -> float:
    """One optimizer step on ``batch`` split into ``accum_steps`` micro-batches; returns the loss.

    Each micro-batch's mean loss is divided by ``accum_steps`` (notebook 02); with masked labels
    the micro-batches score different numbers of tokens, so this is the mean of the micro-batch
    means, close to but not exactly the batch's token mean.
    """
    check_accumulation(batch["input_ids"].shape[0], accum_steps)
    device = next(model.parameters()).device
    batch = _to(batch, device)
    total = torch.zeros((), device=device)
    for micro in [dict(zip(batch, parts)) for parts in zip(*(v.chunk(accum_steps) for v in batch.values()))]:
        with autocast(device, recipe.amp_dtype):
            loss = lm_loss(model, micro, recipe) / accum_steps
        loss.backward()
        total += loss.detach()
    if clip_norm:
        nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def finetune(model: nn.Module, optimizer: torch.optim.Optimizer, batch_iter, steps: int,
             recipe: Recipe = BASELINE, accum_steps: int = 1, clip_norm: float | None = 1.0,
             progress: bool = False) -> list[float]:
    """``steps`` calls of ``finetune_step`` on batches from ``batch_iter``; returns the losses."""
    from tqdm.auto import tqdm

    model.train()
    history = []
    for _ in tqdm(range(steps), disable=not progress, leave=False):
        history.append(finetune_step(model, optimizer, next(batch_iter), recipe, accum_steps, clip_norm))
    return history


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_loss(model: nn.Module, features: list[dict], pad_id: int, batch_size: int = 32,
                  recipe: Recipe = BASELINE) -> float:
    """Mean loss per scored (response) token over tokenized held-out examples."""
    from course_lib.instruct import pad_batch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(features), batch_size):
        batch = _to(pad_batch(features[i:i + batch_size], pad_id), device)
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        with autocast(device, recipe.amp_dtype):
            total += float(lm_loss(model, batch, recipe)) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def greedy_generate(model: nn.Module, tokenizer, instructions: list[str], max_new_tokens: int = 16,
                    amp_dtype: torch.dtype | None = None) -> list[str]:
    """The model's greedy answers to ``instructions`` (formatted with the chat template), up to EOS.

    Prompts of equal token length are batched together, so no padding is needed. ``amp_dtype``
    None: bf16 autocast if the model stores any weight in bf16 (the recipe's frozen weights), else fp32.
    """
    if amp_dtype is None:
        amp_dtype = torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in model.parameters()) else torch.float32
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts = []
    for text in instructions:
        ids = tokenizer(format_prompt(text), add_special_tokens=False)["input_ids"]
        prompts.append(([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids)
    answers: list[str | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    eos = tokenizer.eos_token_id
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        new = []
        for _ in range(max_new_tokens):
            with autocast(device, amp_dtype):
                logits = model(input_ids=ids).logits[:, -1]
            nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            new.append(nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], 1)
            if bool(done.all()):
                break
        out = torch.stack(new, 1).tolist()
        for row, i in zip(out, idx):
            row = row[:row.index(eos)] if eos in row else row
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    model.train(was_training)
    return answers


def exact_match_eval(model: nn.Module, tokenizer, examples, max_new_tokens: int = 16,
                     amp_dtype: torch.dtype | None = None) -> tuple[float, list[str]]:
    """Exact-match score of greedy answers on ``examples``, and the answers."""
    from course_lib.instruct import exact_match

    preds = greedy_generate(model, tokenizer, [e.instruction for e in examples], max_new_tokens, amp_dtype)
    return exact_match(preds, [e.response for e in examples]), preds


# ------------------------------------------------------------------------------ memory planning
def estimate_step_bytes(config, seq_len: int, micro_batch: int, *, lora: bool = False, checkpointing: bool = False,
                        chunked_loss: bool = True, frozen_bytes: int = 2, chunk_tokens: int = Recipe.loss_chunk_tokens,
                        lora_params: int = 0) -> dict[str, int]:
    """Bytes one training step needs, from ``course_lib.memory``'s estimates.

    Model state: full fine-tune, fp32 weights, gradients and AdamW's two states (16 bytes per
    parameter); LoRA, the frozen base at ``frozen_bytes`` per parameter plus 16 per adapter
    parameter. Activations: ``llama_activation_bytes`` in bf16, whose fp32 logits (V per token)
    the chunked loss replaces by one chunk's; the plain loss keeps bf16 logits, their fp32 copy
    and its gradient (about 10 bytes per vocabulary entry and token).
    """
    from course_lib.memory import estimate_model_state, llama_activation_bytes
    from course_lib.models import llama_num_parameters

    n = llama_num_parameters(config)
    if lora:
        state = n * frozen_bytes + 16 * lora_params
    else:
        state = estimate_model_state(n, "float32", "adamw")["total"]
    tokens = micro_batch * seq_len
    acts = llama_activation_bytes(config, micro_batch, seq_len, dtype_bytes=2, checkpointed=checkpointing)
    acts -= tokens * config.vocab_size * 4  # the estimate's fp32 logits, replaced below
    if checkpointing:  # one layer's activations exist again while it is recomputed
        acts += tokens * (10 * config.hidden_size + 4 * config.intermediate_size) * 2
    if chunked_loss:
        logits = min(tokens, chunk_tokens) * config.vocab_size * (4 + 2) + tokens * config.hidden_size * 4
    else:
        logits = tokens * config.vocab_size * (2 + 4 + 4)
    return {"model state": state, "activations": acts, "logits": logits, "total": state + acts + logits}


def plan_micro_batch(config, seq_len: int, device: torch.device | str | None = None, *, micro_batch: int | None = None,
                     lora: bool = False, chunked_loss: bool = True, frozen_bytes: int = 2, max_micro_batch: int = 16,
                     memory_bytes: int | None = None, headroom: float = 0.85, cpu_micro_batch: int = 8,
                     lora_params: int = 0, chunk_tokens: int = Recipe.loss_chunk_tokens) -> dict:
    """Choose the micro-batch and whether to checkpoint, from the device's memory.

    With ``micro_batch`` given (the batch you want per step): that size without checkpointing if
    it fits in ``headroom`` × the memory; else with checkpointing; else the largest size that fits
    with checkpointing, and gradient accumulation to make up the rest. With ``micro_batch=None``:
    the largest power of two up to ``max_micro_batch`` that fits without checkpointing, and
    checkpointing only when not even 1 fits. On a CPU (no ``memory_bytes`` given) the plan is a
    fixed small one: CPU RAM is not the limit there, time is.
    """
    from course_lib.device import default_device, device_memory_bytes

    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda" and memory_bytes is None:
        mb = micro_batch or cpu_micro_batch
        return {"micro_batch": mb, "accum_steps": 1, "checkpointing": False, "estimated_bytes": None,
                "budget_bytes": None, "reason": "CPU: a fixed small plan (time, not memory, is the limit)"}
    budget = headroom * (memory_bytes or device_memory_bytes(device))
    kw = dict(lora=lora, chunked_loss=chunked_loss, frozen_bytes=frozen_bytes, lora_params=lora_params,
              chunk_tokens=chunk_tokens)

    def need(mb: int, ckpt: bool) -> int:
        return estimate_step_bytes(config, seq_len, mb, checkpointing=ckpt, **kw)["total"]

    def plan(mb, ckpt, accum, reason):
        return {"micro_batch": mb, "accum_steps": accum, "checkpointing": ckpt, "estimated_bytes": need(mb, ckpt),
                "budget_bytes": int(budget), "reason": reason}

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
    raise ValueError(f"even micro-batch 1 with checkpointing needs {need(1, True) / 2**30:.1f} GiB and the budget "
                     f"is {budget / 2**30:.1f} GiB: use LoRA, a shorter sequence, or shard the model (FSDP, ZeRO-3)")


# ------------------------------------------------------------------------ launch on an MI300X node
ROCM_IMAGE = "rocm/pytorch-training:v25.3"
NODE_CONFIGS = {"fsdp": "accelerate_fsdp_8gpu.yaml", "zero3": "accelerate_deepspeed_zero3_8gpu.yaml"}


def config_path(name: str = "fsdp") -> Path:
    """Path of a packaged accelerate config for the 8-GPU node: ``"fsdp"`` or ``"zero3"``."""
    if name not in NODE_CONFIGS:
        raise ValueError(f"name={name!r}: choose one of {sorted(NODE_CONFIGS)}")
    return accelerate_configs.CONFIG_DIR / NODE_CONFIGS[name]


def load_accelerate_config(name: str = "fsdp") -> dict:
    """The packaged accelerate config as a dict (it parses as YAML)."""
    return accelerate_configs.load(str(config_path(name)))


def accelerate_launch_command(config: str = "fsdp", *, num_processes: int = 8, preset: str = "8b",
                              model_name: str | None = None, lora: bool = False, steps: int = 20, seq_len: int = 2048,
                              micro_batch: int = 1, dataset_name: str | None = None) -> str:
    """The ``accelerate launch`` line that fine-tunes on a node with ``course_lib.finetune``'s CLI."""
    parts = accelerate_configs.launch_command(str(config_path(config)), "-m", "course_lib.finetune", "--steps", str(steps),
                                              "--seq-len", str(seq_len), "--micro-batch", str(micro_batch),
                                              num_processes=num_processes)
    parts += ["--model-name", model_name] if model_name else ["--preset", preset]
    if dataset_name:
        parts += ["--dataset-name", dataset_name]
    if lora:
        parts.append("--lora")
    return " ".join(parts)


def docker_run_command(image: str = ROCM_IMAGE, name: str = "training_env", shm_size: str = "64G",
                       mounts: tuple[str, ...] = ("$HOME:$HOME", "$HOME/.ssh:/root/.ssh")) -> str:
    """Seed 001's ``docker run`` line for ROCm: the GPU device files (/dev/kfd, /dev/dri), the
    ``video`` group, host IPC and a large /dev/shm (PyTorch's data loaders and RCCL use shared
    memory), host network for multi-node collectives, and ptrace for debuggers and profilers."""
    parts = ["docker", "run", "-it", "--device", "/dev/dri", "--device", "/dev/kfd", "--network", "host",
             "--ipc", "host", "--group-add", "video", "--cap-add", "SYS_PTRACE", "--security-opt", "seccomp=unconfined",
             "--privileged"]
    for m in mounts:
        parts += ["-v", m]
    parts += ["--shm-size", shm_size, "--name", name, image]
    return " ".join(parts)


# ------------------------------------------------------------------- CLI: one rank of a node run
def main(argv: list[str] | None = None) -> dict:
    """Fine-tune under ``accelerate launch`` (FSDP or ZeRO-3 from the config file), or in one process.

    The model is sharded by accelerate, so the loss runs inside the wrapped model
    (``model(..., labels=...)``); the chunked loss needs the LM head's whole weight, which a
    sharded model only has inside its own forward.
    """
    p = argparse.ArgumentParser(prog="python -m course_lib.finetune", description=main.__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-name", default=None)
    p.add_argument("--dataset-name", default=None)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from accelerate import Accelerator

    from course_lib.instruct import load_instruction_data, pack_examples, tokenize_example

    accelerator = Accelerator()
    torch.manual_seed(args.seed)
    data = load_instruction_data(args.dataset_name, n_train=2000, n_test=100, seed=args.seed)
    texts = [format_prompt(e.instruction) + e.response for e in data["train"]]
    tokenizer = load_tokenizer(args.model_name, texts)
    features = [tokenize_example(tokenizer, e) for e in data["train"]]
    packed = pack_examples(features, args.seq_len, tokenizer.pad_token_id)
    # every rank builds (or loads) the model on its CPU before accelerate shards it: with LoRA the frozen
    # base is kept in bf16 (70B: 140 GB per rank of host memory), a full fine-tune keeps fp32 master weights
    model = load_model(args.model_name, preset=args.preset, seed=args.seed,
                       dtype=torch.bfloat16 if args.lora else torch.float32)
    if args.lora:
        model = apply_lora(model)
    optimizer = make_optimizer(model, BASELINE, lr=args.lr, weight_decay=0.01)  # torch's AdamW, its default decay
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    rows, losses = packed["input_ids"].shape[0], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        i = (step * args.micro_batch * accelerator.num_processes
             + accelerator.process_index * args.micro_batch) % max(rows - args.micro_batch + 1, 1)
        batch = {k: v[i:i + args.micro_batch].to(accelerator.device) for k, v in packed.items()}
        loss = lm_loss(model, batch)  # BASELINE: the loss inside the sharded model's own forward
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {step}: loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    tokens = args.steps * args.micro_batch * args.seq_len * accelerator.num_processes
    result = {"losses": losses, "tokens_per_s": tokens / seconds, "world_size": accelerator.num_processes}
    accelerator.print(f"{result['tokens_per_s']:.0f} tokens/s over {accelerator.num_processes} processes")
    return result


if __name__ == "__main__":
    main()
