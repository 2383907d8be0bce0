"""Fine-tuning a Llama, LoRA or full: load, train with the recipe, evaluate, and launch on a node.

    model = load_model(None, preset="tiny")                 # or a Hugging Face name: from_pretrained
    model = apply_lora(model, r=8)                          # course_lib.lora; or leave it for a full fine-tune
    recipe = recipe_for(device)                             # course_lib.recipe: what is fast and lean here
    model = prepare(model, recipe)
    optimizer = make_optimizer(model, recipe, lr=1e-3)
    history = finetune(model, optimizer, batch_iter, steps=100, recipe=recipe)
    score, answers = exact_match_eval(model, tokenizer, test_examples)

Training is the course's one step (``course_lib.train.train_step``) with the recipe's loss and
autocast. ``python -m course_lib.apps.finetune`` is one rank of a run that ``accelerate launch`` starts
on every GPU of a node, with the FSDP or ZeRO-3 config of ``course_lib.apps.accelerate_configs``
(``node_launch_command`` writes the line). On the node, only one full copy of the model exists
(``node_model``), each rank reads its share of every global batch (``distributed.step_batches``),
the loss is the global batch's loss per scored token (``node_step``), the learning rate warms up
and then decays on a cosine, and tokens/s leaves the first steps out.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from torch import nn

from course_lib import attention
from course_lib.apps import accelerate_configs
from course_lib.data import to_device, train_tokenizer
from course_lib.distributed import step_batches
from course_lib.instruct import (IGNORE_INDEX, batches, example_texts, exact_match, load_instruction_data,
                                 pack_for_training, pad_batch, prompt_ids, tokenize_example)
from course_lib.lora import apply_lora, trainable_parameters
from course_lib.loss import scored_tokens
from course_lib.memory import PeakMemory, model_state_bytes
from course_lib.models import build_llama, llama_config
from course_lib.precision import autocast
from course_lib.recipe import BASELINE, Recipe, make_optimizer, prepare
from course_lib.train import fit, train_step


def load_model(model_name: str | None = None, *, preset: str = "tiny", dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = "cpu", attn_implementation: str | None = attention.IMPLEMENTATION,
               seed: int = 0, **overrides) -> nn.Module:
    """A ``LlamaForCausalLM``: random weights from ``preset`` when ``model_name`` is None, else
    ``AutoModelForCausalLM.from_pretrained(model_name)`` (real weights, if you have them: a Hub name, or a local
    directory written by ``save_pretrained``).

    The whole model is built in this process's memory on ``device``; on a node, ``node_model`` builds one copy
    for all ranks instead. ``device=None`` leaves the loaded model where transformers put it (under ZeRO-3,
    already partitioned). Attention is ``course_sdpa`` (a fused kernel in every dtype, or an error);
    ``attn_implementation=None`` keeps transformers' default.
    """
    if model_name is None:
        config = llama_config(preset, **overrides)
        return build_llama(config, dtype=dtype, device=device, attn_implementation=attn_implementation, seed=seed)
    from transformers import AutoModelForCausalLM

    attention.register()
    kwargs = {"dtype": dtype, **overrides}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_name, **kwargs)
    model = model if device is None else model.to(device)
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


def stand_in_base(tokenizer, examples, *, preset: str = "tiny", steps: int, batch: int, lr: float,
                  recipe: Recipe = BASELINE, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """The pretrained model a fine-tune starts from, when there are no real weights: a random ``preset`` Llama
    trained ``steps`` steps on ``examples`` (a task related to the one it will be fine-tuned on, in the same
    template), so that it knows the format and the words but not the task. Notebooks 11 and 12 build the same one."""
    overrides = {"vocab_size": max(len(tokenizer), 512)} if preset == "tiny" else {}
    base = load_model(None, preset=preset, device=device, seed=seed, **overrides)
    run = copy.deepcopy(base)  # prepared (compiled, bf16 frozen weights) for training; the base itself stays plain
    prepare(run, recipe)
    feats = [tokenize_example(tokenizer, e) for e in examples]
    finetune(run, make_optimizer(run, recipe, lr=lr), batches(feats, batch, tokenizer.pad_token_id, seed=seed), steps,
             recipe)
    base.load_state_dict(run.state_dict())
    return base


def fine_tune_and_evaluate(model: nn.Module, tokenizer, train_feats: list[dict], test_feats: list[dict], test_examples,
                           *, steps: int, batch: int, lr: float, recipe: Recipe = BASELINE, seed: int = 0,
                           exact_match: bool = True) -> dict:
    """Fine-tune ``model`` (full, or with adapters: whatever requires a gradient trains) ``steps`` steps on padded
    batches of ``train_feats``, then score it on the held-out examples. Returns the trainable parameters, the memory
    (the peak on a GPU; weights + optimizer states elsewhere), seconds per step, the held-out loss, the exact match of
    greedy answers (None with ``exact_match=False``) and the training losses."""
    device = next(model.parameters()).device
    prepare(model, recipe)
    opt = make_optimizer(model, recipe, lr=lr)
    feed = batches(train_feats, batch, tokenizer.pad_token_id, seed=seed)
    t0 = time.perf_counter()
    if device.type == "cuda":
        with PeakMemory(device) as peak:
            history = finetune(model, opt, feed, steps, recipe)
        memory = peak.peak
    else:
        history = finetune(model, opt, feed, steps, recipe)
        memory = model_state_bytes(model, opt)["total"]  # weights + optimizer states (gradients freed)
    seconds = (time.perf_counter() - t0) / steps
    return {"trainable parameters": trainable_parameters(model), "memory (bytes)": memory, "seconds per step": seconds,
            "held-out loss": evaluate_loss(model, test_feats, tokenizer.pad_token_id, recipe=recipe),
            "exact match": exact_match_eval(model, tokenizer, test_examples)[0] if exact_match else None,
            "losses": history}


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
    prompts = [prompt_ids(tokenizer, text) for text in instructions]
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
                        micro_batch: int = 1, dataset_name: str | None = None, warmup_steps: int | None = None,
                        lr: float | None = None) -> str:
    """The ``accelerate launch`` line that runs this module's CLI on every GPU of a node.

    ``config`` is one of ``accelerate_configs.NODE_CONFIGS`` (FSDP or ZeRO-3 for 8 GPUs) or a YAML path;
    ``dataset_name`` a Hugging Face data set or a local ``.jsonl`` file.
    """
    args = ["-m", "course_lib.apps.finetune", "--steps", str(steps), "--seq-len", str(seq_len),
            "--micro-batch", str(micro_batch)]
    args += ["--model-name", model_name] if model_name else ["--preset", preset]
    args += ["--dataset-name", dataset_name] if dataset_name else []
    args += ["--warmup-steps", str(warmup_steps)] if warmup_steps is not None else []
    args += ["--lr", str(lr)] if lr is not None else []
    args += ["--lora"] if lora else []
    return " ".join(accelerate_configs.launch_command(config, *args, num_processes=num_processes))


# ------------------------------------------------------------------- CLI: one rank of a node run
def node_model(accelerator, model_name: str | None = None, *, preset: str = "tiny",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """This rank's model before ``accelerator.prepare``, built so that the job holds one full copy, not one per rank.

    - FSDP with ``fsdp_cpu_ram_efficient_loading`` (the node configs): rank 0 builds the preset, or reads the
      checkpoint (``from_pretrained``), in its host memory; every other rank builds the same modules on the
      meta device (``accelerate.init_empty_weights``: parameters have shapes and no storage; the buffers, a
      few KiB of RoPE frequencies, stay real). ``prepare`` shards the meta model and sends each rank its
      shards of rank 0's weights (accelerate's ``fsdp2_load_full_state_dict``; FSDP1: ``sync_module_states``).
      Host memory: one copy of the weights, on rank 0; GPU memory: 1/N of them per rank.
    - DeepSpeed ZeRO-3 with ``zero3_init_flag``: the ``Accelerator`` registered its config with transformers
      (``HfDeepSpeedConfig``), so ``from_config`` and ``from_pretrained`` build inside ``deepspeed.zero.Init``:
      each parameter is partitioned as it is created, and ``from_pretrained`` reads the checkpoint on rank 0
      only (the others map it to meta) and scatters it. Host memory: one checkpoint, on rank 0.
    - anything else (DDP, one process): every rank holds the whole model, as DDP needs.

    Call it after ``Accelerator()`` (which starts the process group and sets these up) and before ``prepare``
    (``prepare_model_and_optimizer``: under FSDP2, ``accelerator.prepare`` alone mis-maps a meta model's optimizer).
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    if accelerator.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.is_zero3_init_enabled():
        if model_name is not None:  # transformers reads on rank 0 and partitions under zero.Init
            return load_model(model_name, dtype=dtype, device=None)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        attention.register()
        model = AutoModelForCausalLM.from_config(llama_config(preset), dtype=dtype,
                                                 attn_implementation=attention.IMPLEMENTATION)
        model.config.use_cache = False
        return model
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    if (accelerator.distributed_type == DistributedType.FSDP and fsdp_plugin.cpu_ram_efficient_loading
            and not accelerator.is_main_process):
        return empty_model(model_name, preset=preset, dtype=dtype)
    return load_model(model_name, preset=preset, dtype=dtype, seed=seed)


def empty_model(model_name: str | None = None, *, preset: str = "tiny",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model's modules with every parameter on the meta device (no storage) and real buffers: what a rank
    other than 0 builds before FSDP fills its shards from rank 0. Reads only the config of ``model_name``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    attention.register()
    config = llama_config(preset) if model_name is None else AutoConfig.from_pretrained(model_name)
    with init_empty_weights(include_buffers=False):  # RoPE's inv_freq is computed, not loaded: keep it real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.IMPLEMENTATION)
    model.config.use_cache = False
    return model


def prepare_model_and_optimizer(accelerator, model: nn.Module,
                                optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``accelerator.prepare(model, optimizer)``, with the optimizer holding the prepared model's own parameters.

    Under FSDP2, accelerate swaps each of the optimizer's parameters for its sharded one by matching ``data_ptr()``.
    On a rank that built the model on the meta device (``node_model``, ranks 1-N) every pointer is 0, so every slot
    of the optimizer would get the same one parameter, and that rank's other shards would never move: training goes
    on, silently wrong. So the groups are pointed again at the prepared parameters, matched by name (sharding keeps
    the names), which is right on every rank. Why not the alternatives: accelerate's FSDP2 ``prepare`` refuses a model
    without its optimizer, so the optimizer cannot be made after it; and real (uninitialised) storage on every rank
    is one full copy of the model per rank, what loading on meta exists to avoid. The optimizer has no state before
    its first step, so changing its parameters here loses nothing. Other strategies are left as ``prepare`` makes them.
    """
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    names = {id(p): n for n, p in fsdp2_canonicalize_names(dict(model.named_parameters())).items()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds a parameter that is not the model's: build it from this model's "
                         "parameters (recipe.make_optimizer(model)) before preparing them together")
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    model, optimizer = accelerator.prepare(model, optimizer)
    if getattr(accelerator, "is_fsdp2", False):
        prepared = fsdp2_canonicalize_names(dict(accelerator.unwrap_model(model).named_parameters()))
        for group, group_names in zip(optimizer.param_groups, groups):
            group["params"] = [prepared[n] for n in group_names]
    return model, optimizer


def node_step(model: nn.Module, optimizer, scheduler, batch: dict, accelerator, *,
              clip_norm: float | None = 1.0) -> dict:
    """One optimizer step of this rank on its local share of a global batch; the global batch's numbers.

    The step is the course's one ``train_step`` with ``token_weighted``: the loss is normalised by the scored
    (label != -100) tokens of the GLOBAL batch, summed over all ranks: each rank backpropagates (sum of its
    token losses) / (global count) × world size (``train.token_weights``), and DDP, FSDP and ZeRO average
    the gradients over ranks, so the step's gradient
    is that of the whole batch's mean token loss, what one process computes on it. A per-rank mean would
    give a rank with few scored tokens the weight of one with many. Clipping is the accelerator's
    (``accelerator.clip_grad_norm_``): the norm over all shards under FSDP and DDP; under DeepSpeed the
    engine clips inside ``accelerator.backward`` to the config's ``gradient_clipping`` (``clip_norm`` is not
    used there) and this returns its global norm. The scheduler is stepped here, once per optimizer step.
    Returns the global ``loss`` (equal on every rank), ``grad_norm``, ``lr`` used, ``scored`` and ``real``
    (non-padding) token counts of the global batch.
    """
    batch = to_device(batch, accelerator.device)
    real = (batch["document_ids"] >= 0).sum() if "document_ids" in batch else batch["attention_mask"].sum()
    counts = accelerator.reduce(torch.stack([scored_tokens(batch), real]).to(accelerator.device), reduction="sum")
    lr = scheduler.get_last_lr()[0]
    # token_weighted: this rank's mean loss × its scored tokens × world / the global count (train.token_weights)
    out = train_step(model, optimizer, batch, token_weighted=True, backward=accelerator.backward, clip_norm=clip_norm,
                     clip_grad_norm=accelerator.clip_grad_norm_)
    scheduler.step()
    world = accelerator.num_processes  # the global loss: the mean over ranks of their weighted shares
    total = accelerator.reduce(torch.tensor(out["loss"], device=accelerator.device), reduction="sum") / world
    return {"loss": float(total), "grad_norm": out["grad_norm"], "lr": lr,
            "scored": int(counts[0]), "real": int(counts[1]), "local_scored": int(scored_tokens(batch))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI's arguments, checked."""
    p = argparse.ArgumentParser(prog="python -m course_lib.apps.finetune", description=main.__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="random-weight Llama preset when --model-name is not given")
    p.add_argument("--model-name", default=None, help="Hugging Face name or local directory (from_pretrained)")
    p.add_argument("--dataset-name", default=None, help="Hugging Face data set, 'json', or a .json/.jsonl path")
    p.add_argument("--data-files", default=None, help="files for --dataset-name json (or csv, parquet)")
    p.add_argument("--max-examples", type=int, default=2000, help="at most this many training examples")
    p.add_argument("--long", default="truncate", choices=("truncate", "drop", "error"),
                   help="what to do with an example longer than --seq-len (see instruct.fit_to_length)")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1, help="packed rows per rank per step")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate, reached after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: 10%% of --steps)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="max gradient norm; 0 for none")
    p.add_argument("--timing-warmup", type=int, default=2, help="first steps left out of tokens/s")
    p.add_argument("--report", default=None, help="directory to write each rank's results as rank<N>.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    if args.steps < 1 or args.micro_batch < 1 or args.seq_len < 8:
        p.error("--steps and --micro-batch must be at least 1 and --seq-len at least 8")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps={args.warmup_steps} must be at least 0 and fewer than --steps={args.steps}")
    if args.data_files and not args.dataset_name:
        p.error("--data-files needs --dataset-name (json, csv or parquet)")
    return args


def node_data(args: argparse.Namespace, tokenizer=None) -> tuple[list[dict], dict[str, int], object]:
    """The packed training rows (one dict per row), the counts of kept/truncated/dropped examples, the tokenizer."""
    kwargs = {"data_files": args.data_files} if args.data_files else {}
    data = load_instruction_data(args.dataset_name, n_train=args.max_examples, n_test=0, seed=args.seed, **kwargs)
    tokenizer = tokenizer or load_tokenizer(args.model_name, example_texts(data["train"]))
    packed, counts = pack_for_training(data["train"], tokenizer, args.seq_len, long=args.long)
    rows = [{k: v[i] for k, v in packed.items()} for i in range(len(packed["input_ids"]))]
    return rows, counts, tokenizer


def main(argv: list[str] | None = None) -> dict:
    """Fine-tune under ``accelerate launch`` (FSDP, ZeRO-3 or DDP from the config file), or in one process.

    The model is sharded by accelerate, so the loss runs inside the wrapped model (``model(..., labels=...)``);
    the chunked loss needs the LM head's whole weight, which a sharded model only has inside its own forward.
    Each rank reads its share of every global batch (``distributed.step_batches``: a ``DistributedSampler``,
    reshuffled every epoch, the same global batches for any number of ranks).
    """
    args = parse_args(argv)
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    accelerator = Accelerator()  # first: it starts the process group and tells transformers about ZeRO-3
    torch.manual_seed(args.seed)
    rows, counts, tokenizer = node_data(args)
    accelerator.print(f"data: {len(rows)} packed rows of {args.seq_len} tokens; examples kept {counts['kept']}, "
                      f"truncated {counts['truncated']}, dropped {counts['dropped']} (longer than --seq-len)")
    # a full fine-tune keeps fp32 master weights; with LoRA the frozen base is kept in bf16
    model = node_model(accelerator, args.model_name, preset=args.preset, seed=args.seed,
                       dtype=torch.bfloat16 if args.lora else torch.float32)
    on_meta = any(p.is_meta for p in model.parameters())
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens and the model's vocab_size is "
                         f"{model.config.vocab_size}: use the model's own tokenizer")
    if args.lora:
        model = apply_lora(model)
    optimizer = make_optimizer(model, BASELINE, lr=args.lr, weight_decay=0.01)  # torch's AdamW, its default decay
    model, optimizer = prepare_model_and_optimizer(accelerator, model, optimizer)
    # not prepared: accelerate would step it once per process per step; ours counts optimizer steps
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.steps)
    result = _train(model, optimizer, scheduler, rows, accelerator, args)
    result.update(examples=counts, rows=len(rows), world_size=accelerator.num_processes, model_on_meta=on_meta)
    if args.report:
        from pathlib import Path

        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    return result


def _train(model: nn.Module, optimizer, scheduler, rows: list[dict], accelerator, args) -> dict:
    """The loop: ``node_step`` on this rank's share of each global batch; losses, learning rates and tokens/s.

    tokens/s leaves out the first ``--timing-warmup`` steps (allocation, compilation, caches warming), and is
    given both for positions (``seq_len`` × rows: the compute spent) and for real, non-padding tokens.
    """
    model.train()
    global_batch = args.micro_batch * accelerator.num_processes
    skip = min(args.timing_warmup, args.steps - 1)
    history, t0, positions, real = [], time.perf_counter(), 0, 0
    for step, batch in enumerate(step_batches(rows, global_batch, args.steps, seed=args.seed)):
        if step == skip:
            t0, positions, real = time.perf_counter(), 0, 0
        out = node_step(model, optimizer, scheduler, batch, accelerator, clip_norm=args.clip_norm or None)
        positions, real = positions + global_batch * args.seq_len, real + out["real"]
        history.append(out)
        accelerator.print(f"step {step}: loss {out['loss']:.4f}, lr {out['lr']:.3g}, scored tokens {out['scored']}")
    seconds = time.perf_counter() - t0
    result = {"losses": [h["loss"] for h in history], "lrs": [h["lr"] for h in history],
              "grad_norms": [h["grad_norm"] for h in history], "scored_tokens": [h["scored"] for h in history],
              "local_scored_tokens": [h["local_scored"] for h in history],
              "timed_steps": args.steps - skip, "tokens_per_s": positions / seconds,
              "real_tokens_per_s": real / seconds}
    accelerator.print(f"{result['tokens_per_s']:.0f} tokens/s ({result['real_tokens_per_s']:.0f} real, non-padding) "
                      f"over {accelerator.num_processes} processes, steps {skip}-{args.steps - 1}")
    return result


if __name__ == "__main__":
    main()
