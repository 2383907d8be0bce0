"""Fine-tuning a Llama, LoRA or full: load, train with the recipe, evaluate, and launch on a node.

    model = load_model(None, preset="tiny")                 # or a Hugging Face name: from_pretrained
    model = apply_lora(model, r=8)                          # course_lib.lora; or leave it for a full fine-tune
    recipe = recipe_for(device)                             # course_lib.recipe: what is fast and lean here
    model = prepare(model, recipe)
    optimizer = make_optimizer(model, recipe, lr=1e-3)
    history = finetune(model, optimizer, batch_iter, steps=100, recipe=recipe)
    score, answers = exact_match_eval(model, tokenizer, test_examples)

Training is the course's one step (``course_lib.train.train_step``) with the recipe's loss and
autocast. ``python -m course_lib.finetune`` is one rank of a run that ``accelerate launch`` starts
on every GPU of a node, with the FSDP or ZeRO-3 config of ``course_lib.accelerate_configs``
(``node_launch_command`` writes the line).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from course_lib import accelerate_configs
from course_lib.data import to_device, train_tokenizer
from course_lib.distributed import step_batches
from course_lib.instruct import (IGNORE_INDEX, example_texts, exact_match, format_prompt, load_instruction_data,
                                 pack_for_training, pad_batch)
from course_lib.lora import apply_lora
from course_lib.loss import forward_loss
from course_lib.models import build_llama, llama_config
from course_lib.precision import autocast
from course_lib.recipe import BASELINE, Recipe, make_optimizer
from course_lib.train import fit, train_step


def load_model(model_name: str | None = None, *, preset: str = "tiny", dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str | None = "sdpa", seed: int = 0,
               **overrides) -> nn.Module:
    """A ``LlamaForCausalLM``: random weights from ``preset`` when ``model_name`` is None, else
    ``AutoModelForCausalLM.from_pretrained(model_name)`` (real weights, if you have them).

    ``attn_implementation=None`` keeps transformers' default.
    """
    if model_name is None:
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
    if not texts:
        raise ValueError("texts is needed to train a tokenizer when model_name is None")
    return train_tokenizer("\n".join(texts), vocab_size=vocab_size)


def finetune(model: nn.Module, optimizer: torch.optim.Optimizer, batch_iter, steps: int,
             recipe: Recipe = BASELINE, accum_steps: int = 1, clip_norm: float | None = 1.0,
             progress: bool = False) -> list[float]:
    """``steps`` optimizer steps on batches from ``batch_iter`` with the recipe's loss and autocast; the losses.

    Micro-batches are weighted by the tokens they score (``token_weighted``): with masked prompts they
    score different numbers, and the mean of their means would not be the batch's loss.
    """
    model.train()
    history = fit(model, optimizer, batch_iter, steps, progress=progress, desc="fine-tune", loss_fn=recipe.loss,
                  amp_dtype=recipe.amp_dtype, accum_steps=accum_steps, clip_norm=clip_norm, token_weighted=True)
    return [h["loss"] for h in history]


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_loss(model: nn.Module, features: list[dict], pad_id: int, batch_size: int = 32,
                  recipe: Recipe = BASELINE) -> float:
    """Mean loss per scored (response) token over tokenized held-out examples."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(features), batch_size):
        batch = to_device(pad_batch(features[i:i + batch_size], pad_id), device)
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        with autocast(device, recipe.amp_dtype):
            total += float(recipe.loss(model, batch)) * n
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
    preds = greedy_generate(model, tokenizer, [e.instruction for e in examples], max_new_tokens, amp_dtype)
    return exact_match(preds, [e.response for e in examples]), preds


# ------------------------------------------------------------------------ launch on an MI300X node
def node_launch_command(config: str = "fsdp_8gpu", *, num_processes: int = 8, preset: str = "8b",
                        model_name: str | None = None, lora: bool = False, steps: int = 20, seq_len: int = 2048,
                        micro_batch: int = 1, dataset_name: str | None = None) -> str:
    """The ``accelerate launch`` line that runs this module's CLI on every GPU of a node.

    ``config`` is one of ``accelerate_configs.NODE_CONFIGS`` (FSDP or ZeRO-3 for 8 GPUs) or a YAML path.
    """
    args = ["-m", "course_lib.finetune", "--steps", str(steps), "--seq-len", str(seq_len),
            "--micro-batch", str(micro_batch)]
    args += ["--model-name", model_name] if model_name else ["--preset", preset]
    args += ["--dataset-name", dataset_name] if dataset_name else []
    args += ["--lora"] if lora else []
    return " ".join(accelerate_configs.launch_command(config, *args, num_processes=num_processes))


# ------------------------------------------------------------------- CLI: one rank of a node run
def main(argv: list[str] | None = None) -> dict:
    """Fine-tune under ``accelerate launch`` (FSDP or ZeRO-3 from the config file), or in one process.

    The model is sharded by accelerate, so the loss runs inside the wrapped model (``forward_loss``:
    ``model(..., labels=...)``); the chunked loss needs the LM head's whole weight, which a sharded
    model only has inside its own forward. Each rank reads its share of every global batch
    (``distributed.step_batches``).
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

    accelerator = Accelerator()
    torch.manual_seed(args.seed)
    data = load_instruction_data(args.dataset_name, n_train=2000, n_test=100, seed=args.seed)
    tokenizer = load_tokenizer(args.model_name, example_texts(data["train"]))
    packed = pack_for_training(data["train"], tokenizer, args.seq_len)
    rows = [{k: v[i] for k, v in packed.items()} for i in range(len(packed["input_ids"]))]
    # every rank builds (or loads) the model on its CPU before accelerate shards it: with LoRA the frozen
    # base is kept in bf16 (70B: 140 GB per rank of host memory), a full fine-tune keeps fp32 master weights
    model = load_model(args.model_name, preset=args.preset, seed=args.seed,
                       dtype=torch.bfloat16 if args.lora else torch.float32)
    if args.lora:
        model = apply_lora(model)
    optimizer = make_optimizer(model, BASELINE, lr=args.lr, weight_decay=0.01)  # torch's AdamW, its default decay
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    global_batch = args.micro_batch * accelerator.num_processes
    losses, t0 = [], time.perf_counter()
    for step, batch in enumerate(step_batches(rows, global_batch, args.steps, seed=args.seed)):
        out = train_step(model, optimizer, batch, loss_fn=forward_loss, backward=accelerator.backward)
        losses.append(out["loss"])
        accelerator.print(f"step {step}: loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    tokens = args.steps * global_batch * args.seq_len
    result = {"losses": losses, "tokens_per_s": tokens / seconds, "world_size": accelerator.num_processes}
    accelerator.print(f"{result['tokens_per_s']:.0f} tokens/s over {accelerator.num_processes} processes")
    return result


if __name__ == "__main__":
    main()
