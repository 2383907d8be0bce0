"""The size sweep: the largest Llama-shaped model each strategy trains on this GPU, and how fast (seed 004).

Seed 004's claim is about size: plain PyTorch runs out of GPU memory above about 1.2B parameters on one
32 GB GPU, ZeRO-Offload trains 12B, ZeRO-Infinity (NVMe) 120B. Two answers for this machine:

- predicted, from memory arithmetic: ``predicted_bytes`` adds up ``offload_cost.offload_plan``'s model states, the
  activations and DeepSpeed's fixed buffers on the GPU, the host and NVMe; ``predict_largest`` walks
  ``SWEEP_SHAPES`` until one of the three is full.
- measured, on a GPU: ``search_largest`` grows the model, then the micro-batch, until
  ``torch.OutOfMemoryError`` (freed, and recorded), with ``train_trial`` as the real step: torch's AdamW under
  bf16 autocast, or DeepSpeed's engine with the optimizer (and for ZeRO-3 the weights) offloaded. Each
  strategy runs in a fresh process (``sweep_all``); ``python -m course_lib.apps.size_sweep`` prints the table.

An application of ``zero_deepspeed`` (the configs, the step), ``offload_cost`` (the offload strategies) and ``train``
(the plain step).
"""

from __future__ import annotations

import argparse
import functools
import importlib
from typing import Callable

import torch
from torch import nn

from course_lib import attention
from course_lib.checkpointing import checkpoint_layers, transformer_layers
from course_lib.data import random_tokens
from course_lib.parallel.zero_deepspeed import deepspeed_step, ds_config
from course_lib.device import device_memory_bytes, free_memory, host_memory_bytes
from course_lib.distributed import rank_device
from course_lib.launch import launch
from course_lib.memory import llama_activation_bytes
from course_lib.models import llama_config, llama_num_parameters
from course_lib.throughput import device_peak, matmul_parameters, time_step, transformer_flops_per_token
from course_lib.train import train_step
from course_lib.parallel.offload_cost import OFFLOAD_STRATEGIES, STRATEGY_NAMES, check_strategy, offload_plan

# Llama-shaped models from 0.5B to 431B parameters: hidden size and layers (heads of 128, 8 KV heads, an MLP of
# 3.5 × the hidden size, Llama 3's vocabulary, untied head). (4096, 32) is Llama-3.1-8B's shape, (8192, 80) 70B's.
SWEEP_SHAPES = [(1024, 16), (1536, 16), (2048, 16), (2048, 24), (2560, 24), (3072, 28), (4096, 24), (4096, 32),
                (4096, 48), (5120, 40), (5120, 60), (6144, 60), (7168, 64), (8192, 80), (10240, 88), (12288, 96),
                (16384, 126)]
MICRO_BATCHES = [1, 2, 4, 8, 16, 32, 64]
# fixed GPU working sets of DeepSpeed's defaults: two bf16 reduce buckets of 5e8 elements (ZeRO-2), and at most
# stage3_max_live_parameters = 1e9 bf16 weights gathered at once plus a prefetch bucket of 5e7 (ZeRO-3)
_GPU_WORKING_SET = {"pytorch": 0, "zero2_offload": 2 * 5e8 * 2, "zero3_offload": (1e9 + 5e7) * 2,
                    "zero3_nvme": (1e9 + 5e7) * 2}


@functools.lru_cache(maxsize=None)
def sweep_config(hidden: int, layers: int, vocab_size: int = 128256, seq_len: int = 1024, heads_dim: int = 128):
    """A Llama config of the sweep's shape: ``hidden`` wide, ``layers`` deep, Llama 3's other proportions."""
    if hidden % heads_dim or hidden < heads_dim or layers < 1:
        raise ValueError(f"hidden={hidden}, layers={layers}: hidden must be a multiple of {heads_dim} and layers >= 1")
    heads = hidden // heads_dim
    return llama_config("8b", hidden_size=hidden, num_hidden_layers=layers,
                        intermediate_size=int(3.5 * hidden) // 256 * 256, num_attention_heads=heads,
                        num_key_value_heads=min(8, heads), vocab_size=vocab_size,
                        max_position_embeddings=max(seq_len, 128))


def predicted_bytes(strategy: str, config, micro_batch: int, seq_len: int,
                    checkpointing: bool = False) -> dict[str, float]:
    """Bytes a training step of ``strategy`` needs on the GPU, in host memory and on NVMe (a prediction).

    Model state from ``offload_plan`` (plus DeepSpeed's pinned bf16 copy of the weights on the host with
    ZeRO-2 offload, and its fixed buffers); activations from ``memory.llama_activation_bytes`` in bf16, with the
    plain loss's logits (bf16, their fp32 copy and its gradient: 10 bytes per vocabulary entry and token);
    with ``checkpointing`` each layer keeps only its input, and one layer's activations exist again at a time.
    """
    n = llama_num_parameters(config)
    where = {"GPU": 0.0, "CPU": 0.0, "NVMe": 0.0}
    for row in offload_plan(strategy, n):
        where[row["lives on"]] += row["bytes on this rank"]
    if strategy == "zero2_offload":
        where["CPU"] += 2 * n  # the pinned bf16 buffer the updated weights go up from
    if strategy == "zero3_nvme":
        where["CPU"] += 4 * 2**30  # pinned swap buffers
    tokens = micro_batch * seq_len
    acts = llama_activation_bytes(config, micro_batch, seq_len, dtype_bytes=2, checkpointed=checkpointing,
                                  logits_bytes=0, recomputing=True)
    acts += tokens * config.vocab_size * 10
    where["GPU"] += acts + min(_GPU_WORKING_SET[strategy], 2 * n)
    return where


def predict_largest(strategy: str, gpu_bytes: float, host_bytes: float, nvme_bytes: float = 0.0, *,
                    seq_len: int = 1024, micro_batch: int = 1, shapes=SWEEP_SHAPES, headroom: float = 0.9,
                    checkpointing: bool = False) -> dict:
    """The largest sweep shape whose predicted step fits: ``headroom`` × the GPU, 0.8 × the host RAM, the NVMe space.

    A prediction from memory arithmetic, not a measurement. Returns the shape, its parameters and which
    memory stopped the next shape ("GPU", "CPU", "NVMe"), or ``n_params`` 0 when not even the first fits.
    """
    check_strategy(strategy)
    limits = {"GPU": headroom * gpu_bytes, "CPU": 0.8 * host_bytes, "NVMe": nvme_bytes}
    best = {"strategy": strategy, "shape": None, "n_params": 0, "limited by": None}
    for hidden, layers in shapes:
        config = sweep_config(hidden, layers, seq_len=seq_len)
        need = predicted_bytes(strategy, config, micro_batch, seq_len, checkpointing)
        over = [k for k, v in need.items() if v > limits[k]]
        if over:
            best["limited by"] = over[0]
            break
        best.update(shape=(hidden, layers), n_params=llama_num_parameters(config))
    return best


def is_out_of_memory(err: BaseException) -> bool:
    """An out-of-memory error: torch's ``OutOfMemoryError``, or a RuntimeError saying so (a pinned host allocation)."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def attempt(trial: Callable[[tuple, int], dict], shape: tuple, micro_batch: int) -> dict:
    """Run ``trial(shape, micro_batch)``; an out-of-memory error becomes ``fits=False`` with the memory freed."""
    try:
        return {"shape": tuple(shape), "micro_batch": micro_batch, "fits": True, **trial(shape, micro_batch)}
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        message = str(err).strip().splitlines()[0][:200]
    free_memory()  # outside the except block: the traceback (and every tensor its frames hold) is gone by now
    return {"shape": tuple(shape), "micro_batch": micro_batch, "fits": False, "error": message}


def search_largest(trial: Callable[[tuple, int], dict], shapes=SWEEP_SHAPES, micro_batches=MICRO_BATCHES,
                   batch_shapes: tuple = ()) -> dict:
    """Grow the model through ``shapes`` at the smallest micro-batch until a trial runs out of memory; then grow
    the micro-batch of the largest shape that trained (and of each of ``batch_shapes`` that trained) until it does.

    Returns every attempt (``rows``), the largest shape that trained (``largest``: its row at the largest
    micro-batch that fitted), and that best row for each shape whose batch was grown (``best_by_shape``).
    """
    if not shapes or not micro_batches or sorted(micro_batches) != list(micro_batches):
        raise ValueError(f"shapes={shapes}, micro_batches={micro_batches}: "
                         "give at least one of each, batches ascending")
    rows, fitted = [], {}
    for shape in shapes:
        rows.append(attempt(trial, shape, micro_batches[0]))
        if not rows[-1]["fits"]:
            break
        fitted[tuple(shape)] = rows[-1]
    largest = list(fitted)[-1] if fitted else None
    best = {}
    for shape in dict.fromkeys([*map(tuple, batch_shapes), *([largest] if largest else [])]):
        if shape not in fitted:
            continue
        best[shape] = fitted[shape]
        for mb in micro_batches[1:]:
            rows.append(attempt(trial, shape, mb))
            if not rows[-1]["fits"]:
                break
            best[shape] = rows[-1]
    return {"rows": rows, "largest": best.get(largest), "best_by_shape": best}


def _build_llama_in(config, device: torch.device, dtype: torch.dtype):
    """A random-weight Llama built directly on ``device`` in ``dtype`` (no fp32 copy first: the sweep's sizes
    are at the edge of memory). Inside ``deepspeed.zero.Init`` each layer is partitioned as it is built."""
    from transformers import LlamaForCausalLM

    attention.register()
    config._attn_implementation = attention.IMPLEMENTATION
    config.use_cache = False
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def _refuse_if_too_big(strategy: str, config, micro_batch: int, seq_len: int, device: torch.device,
                       checkpointing: bool) -> None:
    """Raise ``OutOfMemoryError`` before building what cannot fit: host RAM exhausted is not an exception but
    the kernel's OOM killer, and fp32 weights beyond the GPU fail slowly."""
    need = predicted_bytes(strategy, config, micro_batch, seq_len, checkpointing)
    if need["CPU"] > 0.9 * host_memory_bytes():
        raise torch.OutOfMemoryError(f"host memory: {strategy} needs about {need['CPU'] / 2**30:.0f} GiB of the "
                                     f"{host_memory_bytes() / 2**30:.0f} GiB here (predicted, not tried)")
    weights = 4 * llama_num_parameters(config) if strategy == "pytorch" else 0
    if device.type == "cuda" and weights > 0.9 * device_memory_bytes(device):
        raise torch.OutOfMemoryError(f"GPU memory: the fp32 weights alone need {weights / 2**30:.0f} GiB")


def train_trial(strategy: str, config, micro_batch: int, seq_len: int, steps: int = 3, warmup: int = 1,
                nvme_path: str | None = None, cpu_adam: bool = True, checkpointing: bool = False) -> dict:
    """Train a Llama of ``config`` with ``strategy`` for ``warmup`` + ``steps`` steps on random tokens, on this
    rank's device: tokens/s, TFLOP/s (6·N + attention per token, ``course_lib.throughput``) and peak GPU memory.

    "pytorch": fp32 weights, torch's AdamW, bf16 autocast (``train_step``). The ZeRO strategies: DeepSpeed's
    engine in bf16 with the optimizer offloaded (``cpu_adam`` picks DeepSpeed's CPU Adam, else torch's AdamW), and
    for ZeRO-3 the weights too, to the CPU or to ``nvme_path`` ("zero3_nvme"). ``checkpointing`` recomputes
    each decoder layer in the backward (transformers' non-reentrant checkpointing). Out of memory raises.
    """
    check_strategy(strategy)
    if strategy == "zero3_nvme" and not nvme_path:
        raise ValueError("strategy='zero3_nvme' needs nvme_path: a folder on the NVMe drive (and libaio)")
    device = rank_device()
    _refuse_if_too_big(strategy, config, micro_batch, seq_len, device, checkpointing)
    tokens = random_tokens(micro_batch, seq_len, config.vocab_size).to(device)
    batch = {"input_ids": tokens, "labels": tokens}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = None
    try:
        if strategy == "pytorch":
            model = _checkpointed(_build_llama_in(config, device, torch.float32), checkpointing)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            step = lambda: train_step(model, optimizer, batch, amp_dtype=torch.bfloat16)  # noqa: E731
        else:
            engine = _offload_engine(strategy, config, micro_batch, device, nvme_path, cpu_adam, checkpointing)
            optimizer = engine.optimizer.optimizer  # the torch or DeepSpeed optimizer inside ZeRO's
            step = lambda: deepspeed_step(engine, batch, 1)  # noqa: E731
        timing = time_step(step, device, warmup=warmup, repeat=steps)
    finally:
        if engine is not None:
            engine.destroy()
    n = llama_num_parameters(config)
    tokens_per_s = micro_batch * seq_len / timing["median_s"]
    flops = transformer_flops_per_token(matmul_parameters(n, config.vocab_size, config.hidden_size, False),
                                        config.num_hidden_layers, config.hidden_size, seq_len)
    peak = device_peak(device)  # which card's peak MFU is against, and why: printed with the sweep's table
    return {"n_params": n, "seq_len": seq_len, "optimizer": type(optimizer).__name__, "step_s": timing["median_s"],
            "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops / 1e12,
            "mfu": tokens_per_s * flops / peak.flops if peak else None, "peak": peak.describe() if peak else None,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _checkpointed(model: nn.Module, checkpointing: bool) -> nn.Module:
    if checkpointing:  # notebook 04's whole-block checkpointing
        checkpoint_layers(transformer_layers(model))
    return model


def _offload_engine(strategy: str, config, micro_batch: int, device: torch.device, nvme_path: str | None,
                    cpu_adam: bool, checkpointing: bool):
    """A DeepSpeed engine for one of the offload strategies, its model built where that strategy keeps it."""
    import deepspeed

    stage = 2 if strategy == "zero2_offload" else 3
    cfg = ds_config(train_batch=micro_batch, accum_steps=1, world_size=1, stage=stage, offload_optimizer=True,
                    offload_param=stage == 3, mixed_precision="bfloat16", cpu_adam=cpu_adam,
                    nvme_path=nvme_path if strategy == "zero3_nvme" else None)
    if stage == 3:  # never whole anywhere: each layer goes to the CPU (or NVMe) as it is built
        # zero.Init patches torch.Tensor.__new__: a module that transformers imports lazily (torch._dynamo
        # through its masking utilities) fails to import inside it, so both are imported first
        importlib.import_module("torch._dynamo")
        importlib.import_module("transformers.models.llama.modeling_llama")
        with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
            model = _build_llama_in(config, device, torch.bfloat16)
    else:
        model = _build_llama_in(config, device, torch.bfloat16)
    model = _checkpointed(model, checkpointing)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def sweep(strategy: str = "pytorch", shapes: list | None = None, micro_batches: list | None = None, seq_len: int = 1024,
          steps: int = 3, warmup: int = 1, batch_shapes: list | None = None, nvme_path: str | None = None,
          cpu_adam: bool = True, checkpointing: bool = False, vocab_size: int = 128256) -> dict:
    """The worker the size sweep launches, one process per strategy (a clean slate: no engine's leftovers): the
    largest ``SWEEP_SHAPES`` model ``strategy`` trains on this rank's device, and its best micro-batch."""
    shapes = [tuple(s) for s in (shapes or SWEEP_SHAPES)]

    def trial(shape, micro_batch):
        config = sweep_config(*shape, vocab_size=vocab_size, seq_len=seq_len)
        return train_trial(strategy, config, micro_batch, seq_len, steps, warmup, nvme_path, cpu_adam, checkpointing)

    found = search_largest(trial, shapes, micro_batches or MICRO_BATCHES, [tuple(s) for s in batch_shapes or ()])
    return {"strategy": strategy, "cpu_adam": cpu_adam, "checkpointing": checkpointing, "rows": found["rows"],
            "largest": found["largest"],
            "best_by_shape": list(found["best_by_shape"].values())}


def sweep_table(results: list[dict]) -> list[dict]:
    """One row per sweep result: the largest model that trained, at its largest micro-batch, and how fast."""
    rows = []
    for r in results:
        best = r["largest"] or {}
        name = STRATEGY_NAMES[r["strategy"]] + ("" if r["strategy"] == "pytorch" else
                                                 " (DeepSpeed CPU Adam)" if r["cpu_adam"] else " (torch AdamW)")
        rows.append({"strategy": name, "largest model": f"{best.get('n_params', 0) / 1e9:.2f}B",
                     "shape (hidden, layers)": best.get("shape"), "micro-batch": best.get("micro_batch"),
                     "tokens/s": best.get("tokens_per_s"), "TFLOP/s": best.get("tflops"),
                     "peak GPU GiB": (best.get("peak_gpu_bytes") or 0) / 2**30,
                     "stopped by": next((x["error"] for x in r["rows"] if not x["fits"]), "nothing: the list ended")})
    return rows


def sweep_all(strategies=("pytorch", "zero2_offload", "zero3_offload"), shapes=SWEEP_SHAPES, *, seq_len: int = 1024,
              steps: int = 3, micro_batches=MICRO_BATCHES, batch_shapes=(), nvme_path: str | None = None,
              cpu_adam: bool = True, checkpointing: bool = False, timeout: float = 24 * 3600) -> list[dict]:
    """``sweep`` for each strategy, each in a fresh one-rank process (``launch``) on this machine's first GPU."""
    return [launch("course_lib.apps.size_sweep:sweep", 1, {"strategy": s, "shapes": [list(x) for x in shapes],
                                                "seq_len": seq_len, "steps": steps,
                                                "micro_batches": list(micro_batches),
                                                "batch_shapes": [list(x) for x in batch_shapes], "nvme_path": nvme_path,
                                                "cpu_adam": cpu_adam, "checkpointing": checkpointing},
                   timeout=timeout, echo=False)[0]
            for s in strategies]


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m course_lib.apps.size_sweep``: the size sweep on this machine's first GPU, printed as a table."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.apps.size_sweep", description=main.__doc__)
    parser.add_argument("--strategies", nargs="+", default=["pytorch", "zero2_offload", "zero3_offload"],
                        choices=sorted(OFFLOAD_STRATEGIES))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-params", type=float, default=None, help="skip shapes above this many parameters")
    parser.add_argument("--nvme-path", default=None, help="a folder on an NVMe drive, for zero3_nvme (needs libaio)")
    parser.add_argument("--checkpointing", action="store_true", help="recompute each layer in the backward")
    parser.add_argument("--torch-adam", action="store_true",
                        help="torch's AdamW on the CPU instead of DeepSpeed's CPU Adam")
    args = parser.parse_args(argv)
    shapes = [s for s in SWEEP_SHAPES if not args.max_params or
              llama_num_parameters(sweep_config(*s, seq_len=args.seq_len)) <= args.max_params]
    results = sweep_all(args.strategies, shapes, seq_len=args.seq_len, steps=args.steps, nvme_path=args.nvme_path,
                        cpu_adam=not args.torch_adam, checkpointing=args.checkpointing)
    for row in sweep_table(results):
        print(" | ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    return results


if __name__ == "__main__":
    main()
