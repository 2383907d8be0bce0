"""The losses of the course: the mean loss of a batch, and a language-model loss that never builds
the whole batch's logits.

A *batch* is what ``train.train_step`` splits into micro-batches, in one of three forms:

- ``(inputs, targets)``: a classifier's cross-entropy, or, when the model returns (batch, T, V)
  logits, a causal LM's next-token loss (position t predicts token t+1);
- a tensor of token ids: a causal LM trained on the text itself (targets = inputs);
- a dict with ``input_ids`` and ``labels`` (instruction data, ``course_lib.instruct``): the
  next-token loss on the positions whose label is not -100, with ``attention_mask``,
  ``position_ids`` and, for packed rows, ``document_ids`` (each document attends to itself only).

``forward_loss`` is the plain loss of all three. ``lm_loss`` is the fine-tune recipe's loss of a
dict batch: the LM head and the cross-entropy run chunk by chunk over tokens, and each chunk's
gradients are computed at once, so only one chunk's logits ever exist. With a 128k vocabulary,
batch 4 and 2048 tokens, the whole batch's logits are 4 GiB in fp32, plus as much again for
their gradient; one chunk of ``LOSS_CHUNK_TOKENS`` tokens is 2 GiB, and none outlives its chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.instruct import IGNORE_INDEX, packed_attention_mask
from course_lib.models import unwrap_causal_lm

# Tokens per chunk of the chunked loss: the recipe, its memory plan and chunked_lm_loss all use this one.
LOSS_CHUNK_TOKENS = 4096


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments a Llama's forward takes from a dict batch; packed rows get their block mask."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    if "document_ids" in batch:  # packed rows: keep documents apart
        inputs["attention_mask"] = packed_attention_mask(batch["document_ids"])
    return inputs


def scored_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """How many next-token targets a dict batch scores: its labels that are not -100, the first position
    of each row left out (nothing before it predicts it)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (batch, T, V) logits against (batch, T) tokens, position t scored on token t+1.

    The logits go to float32 for the softmax (a bf16 log-softmax loses the small probabilities);
    targets of -100 are ignored.
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


def forward_loss(model: nn.Module, batch) -> torch.Tensor:
    """The mean loss of a batch in any of the three forms of this module's docstring."""
    if isinstance(batch, dict):
        return model(**model_inputs(batch), labels=batch["labels"]).loss
    inputs, targets = (batch, batch) if torch.is_tensor(batch) else batch
    out = model(inputs)
    logits = getattr(out, "logits", out)
    if logits.dim() == 3:  # causal LM
        return next_token_loss(logits, targets)
    return F.cross_entropy(logits.float(), targets)


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


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    chunk_tokens: int = LOSS_CHUNK_TOKENS, compute_dtype: torch.dtype | None = None,
                    fused: bool = False) -> torch.Tensor:
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


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], *, chunk_tokens: int = LOSS_CHUNK_TOKENS,
            fused: bool = False) -> torch.Tensor:
    """``forward_loss`` of a dict batch, computed chunk by chunk from the decoder's hidden states.

    The model may be a PEFT (LoRA) wrapper. It must hold its LM head's whole weight: a model sharded
    by FSDP or ZeRO-3 has it only inside its own forward, so there ``forward_loss`` is the loss to use.
    """
    lm = unwrap_causal_lm(model)
    hidden = lm.model(**model_inputs(batch)).last_hidden_state
    return chunked_lm_loss(hidden, lm.lm_head.weight, batch["labels"], chunk_tokens=chunk_tokens, fused=fused)
