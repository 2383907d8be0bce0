"""The course's fine-tune recipe against a plain baseline, side by side, in one process.

    python -m course_lib.benchmark                               # CPU: a tiny shape, seconds
    python -m course_lib.benchmark --preset 1b --seq 2048 --steps 20 --micro-batch 4
    python -m course_lib.benchmark --preset 8b --seq 2048 --steps 10 --micro-batch 4 --lora

Both runs build the same model from the same seed (identical weights), see the same batches
(instruction examples packed into rows of ``seq`` tokens, prompts masked), and run the same
number of steps; the baseline first, then its memory is freed, then the recipe
(``course_lib.recipe``), each through the course's one ``train_step``. Warm-up steps (where ``torch.compile`` compiles and kernels are
selected) are trained but not timed. The table gives, per run: tokens/s, MFU against the
device's bf16 peak (``course_lib.throughput``), peak memory (``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``; n/a on a CPU), the loss after the last step, and whether
activation checkpointing was needed (``plan_micro_batch``), plus the ratio recipe / baseline.

MFU counts 6·N + 12·L·d·T FLOPs per token, 4·N + 12·L·d·T when the base weights are frozen
(LoRA), N all parameters (embedding included, a tied LM head once).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace

import torch

from course_lib.data import train_tokenizer
from course_lib.device import default_device
from course_lib.finetune import load_model
from course_lib.instruct import example_texts, make_examples, pack_for_training
from course_lib.lora import ALL_LINEAR, apply_lora, trainable_parameters
from course_lib.models import llama_config, llama_num_parameters
from course_lib.recipe import BASELINE, Recipe, make_optimizer, plan_micro_batch, prepare, recipe_for
from course_lib.throughput import mfu, peak_bf16_flops, transformer_flops_per_token
from course_lib.train import train_step

CPU_DEFAULTS = dict(preset="tiny", seq_len=128, micro_batch=4, steps=4, warmup=1)
GPU_DEFAULTS = dict(preset="1b", seq_len=2048, micro_batch=4, steps=20, warmup=5)


def packed_batches(n_batches: int, micro_batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """``n_batches`` batches of instruction examples packed into rows (labels masked on prompts).

    The rows are plain causal (no per-document mask), as in most packed pre-training: the same
    for both runs, and the fastest attention kernels apply.
    """
    rows_needed = n_batches * micro_batch
    n_examples = min(max(200, rows_needed * seq_len // 20 + 50), 12000)
    examples = make_examples("reverse", n_examples, seed=seed, n_words=4)
    tok = train_tokenizer("\n".join(example_texts(examples[:2000])), vocab_size=min(512, vocab_size))
    packed = pack_for_training(examples, tok, seq_len)
    ids, labels = packed["input_ids"], packed["labels"]
    rows = ids.shape[0]
    out = []
    for b in range(n_batches):
        idx = [(b * micro_batch + i) % rows for i in range(micro_batch)]
        out.append({"input_ids": ids[idx].clone(), "labels": labels[idx].clone()})
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 (dynamo absent or already clean)
        pass


def run_one(recipe: Recipe, batches: list[dict], *, preset: str, seq_len: int, micro_batch: int, warmup: int,
            lora: bool, lora_r: int, device: torch.device, seed: int, lr: float, **overrides) -> dict:
    """Train ``len(batches)`` steps with ``recipe``; time the steps after ``warmup``."""
    config = llama_config(preset, **overrides)
    n_params = llama_num_parameters(config)
    model = load_model(None, preset=preset, device=device, attn_implementation=recipe.attn_implementation, seed=seed,
                       **overrides)
    if lora:
        model = apply_lora(model, r=lora_r, target_modules=ALL_LINEAR)
    frozen_bytes = 2 if (lora and recipe.frozen_weights_bf16) else 4
    plan = plan_micro_batch(config, seq_len, device, micro_batch=micro_batch, lora=lora,
                            chunked_loss=recipe.chunked_loss, frozen_bytes=frozen_bytes,
                            chunk_tokens=recipe.loss_chunk_tokens, lora_params=trainable_parameters(model) if lora else 0)
    if plan["accum_steps"] != 1:
        raise ValueError(f"micro_batch={micro_batch} does not fit even with checkpointing ({plan}): pick a smaller one")
    recipe = replace(recipe, checkpointing=plan["checkpointing"])
    prepare(model, recipe)
    optimizer = make_optimizer(model, recipe, lr=lr)
    model.train()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, t0 = [], None
    for i, batch in enumerate(batches):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        out = train_step(model, optimizer, batch, loss_fn=recipe.loss, amp_dtype=recipe.amp_dtype)
        losses.append(out["loss"])  # a float: synchronises every step
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    timed = len(batches) - warmup
    tokens_per_s = timed * micro_batch * seq_len / seconds
    flops = transformer_flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, seq_len,
                                        frozen_base=lora)
    peak = peak_bf16_flops(device)
    out = {"recipe": recipe.name, "tokens_per_s": tokens_per_s, "step_s": seconds / timed,
           "mfu": mfu(tokens_per_s, flops, peak) if peak else None, "flops_per_token": flops,
           "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "loss": losses[-1], "losses": losses, "checkpointing": recipe.checkpointing, "compile": recipe.compile,
           "trainable_parameters": trainable_parameters(model)}
    del model, optimizer
    _free(device)
    return out


def benchmark(preset: str | None = None, seq_len: int | None = None, micro_batch: int | None = None,
              steps: int | None = None, warmup: int | None = None, *, lora: bool = False, lora_r: int = 16,
              device: torch.device | str | None = None, seed: int = 0, lr: float | None = None,
              compile: bool | None = None, **overrides) -> dict:
    """Baseline then recipe on the same shapes, weights and batches; returns both and their ratios.

    Unset sizes take the device's defaults (``CPU_DEFAULTS`` or ``GPU_DEFAULTS``); ``steps``
    counts the timed steps, ``warmup`` the untimed ones before them.
    """
    device = torch.device(device) if device is not None else default_device()
    d = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    preset, seq_len = preset or d["preset"], seq_len or d["seq_len"]
    micro_batch, steps = micro_batch or d["micro_batch"], steps or d["steps"]
    warmup = d["warmup"] if warmup is None else warmup
    lr = lr if lr is not None else (1e-4 if lora else 2e-5) * (10 if preset in ("tiny", "small") else 1)
    vocab = llama_config(preset, **overrides).vocab_size
    batches = packed_batches(warmup + steps, micro_batch, seq_len, vocab, seed=seed)
    common = dict(preset=preset, seq_len=seq_len, micro_batch=micro_batch, warmup=warmup, lora=lora, lora_r=lora_r,
                  device=device, seed=seed, lr=lr, **overrides)
    rows = {"baseline": run_one(BASELINE, batches, **common),
            "recipe": run_one(recipe_for(device, compile=compile), batches, **common)}
    b, r = rows["baseline"], rows["recipe"]
    ratio = {"tokens_per_s": r["tokens_per_s"] / b["tokens_per_s"],
             "mfu": r["mfu"] / b["mfu"] if r["mfu"] and b["mfu"] else None,
             "peak_memory_bytes": (r["peak_memory_bytes"] / b["peak_memory_bytes"]
                                   if r["peak_memory_bytes"] and b["peak_memory_bytes"] else None),
             "loss": r["loss"] / b["loss"]}
    return {"shape": {"preset": preset, "seq_len": seq_len, "micro_batch": micro_batch, "steps": steps,
                      "warmup": warmup, "lora": lora, "device": str(device),
                      "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"},
            "baseline": b, "recipe": r, "ratio": ratio}


def format_table(result: dict) -> str:
    """The benchmark as a markdown table."""
    s = result["shape"]

    def fmt(v, kind):
        if v is None:
            return "n/a"
        if kind == "tok":
            return f"{v:,.0f}"
        if kind == "mfu":
            return f"{100 * v:.1f}%"
        if kind == "mem":
            return f"{v / 2**30:.1f} GiB"
        return f"{v:.4f}"

    head = (f"{s['preset']} shape, sequence {s['seq_len']}, micro-batch {s['micro_batch']}, "
            f"{'LoRA' if s['lora'] else 'full fine-tune'}, {s['steps']} timed steps after {s['warmup']} warm-up, "
            f"on {s['device_name']}\n\n")
    lines = ["| run | tokens/s | MFU | peak memory | loss after the steps | checkpointing | compile |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for name in ("baseline", "recipe"):
        r = result[name]
        lines.append(f"| {name} | {fmt(r['tokens_per_s'], 'tok')} | {fmt(r['mfu'], 'mfu')} | "
                     f"{fmt(r['peak_memory_bytes'], 'mem')} | {fmt(r['loss'], 'loss')} | {r['checkpointing']} | "
                     f"{r['compile']} |")
    q = result["ratio"]
    f2 = lambda v: "n/a" if v is None else f"{v:.2f}x"  # noqa: E731
    lines.append(f"| recipe / baseline | {f2(q['tokens_per_s'])} | {f2(q['mfu'])} | {f2(q['peak_memory_bytes'])} | "
                 f"{f2(q['loss'])} | | |")
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """``python -m course_lib.benchmark``: the baseline and the recipe on one shape, printed as a table (``--json`` saves it)."""
    p = argparse.ArgumentParser(prog="python -m course_lib.benchmark",
                                description="Fine-tune recipe vs plain baseline, same shapes, one process.")
    p.add_argument("--preset", default=None, help="a course_lib.models.LLAMA_PRESETS name (CPU default tiny, GPU 1b)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (CPU 128, GPU 2048)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (CPU 4, GPU 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (CPU 1, GPU 5)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 4)")
    p.add_argument("--lora", action="store_true", help="LoRA (r 16 on every linear layer) instead of full fine-tune")
    p.add_argument("--no-compile", action="store_true", help="recipe without torch.compile")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    result = benchmark(a.preset, a.seq, a.micro_batch, a.steps, a.warmup, lora=a.lora, device=a.device, seed=a.seed,
                       compile=False if a.no_compile else None)
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
