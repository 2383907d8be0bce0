"""Where training memory goes, estimated from sizes and measured from tensors.

Model state per parameter with Adam (the usual accounting):

| training          | weights | gradients | Adam m, v | total      |
| ----------------- | ------- | --------- | --------- | ---------- |
| float32           | 4       | 4         | 8         | 16 bytes   |
| autocast 16-bit   | 4       | 4         | 8         | 16 bytes   |
| pure bf16 weights | 2       | 2         | 4         | 8 bytes    |

(autocast keeps float32 master weights; the 16-bit copies it makes are transient.)
Activations come on top and grow with batch × sequence; they are what checkpointing cuts.

On a GPU the allocator's peak is the measurement. On a CPU there is no such counter, so
``SavedTensorMeter`` counts the bytes autograd keeps for backward, which is the
activation memory by definition, and ``model_state_bytes`` sums the tensors that hold
weights, gradients and optimizer states.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

BYTES_PER = {"float32": 4, "float16": 2, "bfloat16": 2}


def training_bytes_per_param(weight_dtype: str = "float32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per parameter for weights, gradients and optimizer states."""
    if weight_dtype not in BYTES_PER:
        raise ValueError(f"weight_dtype={weight_dtype!r}: use one of {sorted(BYTES_PER)}")
    states = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(states)}")
    b = BYTES_PER[weight_dtype]
    return {"weights": b, "gradients": b, "optimizer states": states[optimizer] * b}


def estimate_model_state(n_params: int, weight_dtype: str = "float32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes of weights, gradients and optimizer states for ``n_params`` parameters."""
    per = training_bytes_per_param(weight_dtype, optimizer)
    out = {k: v * n_params for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


def llama_activation_bytes(config, batch: int, seq: int, dtype_bytes: int = 4, checkpointed: bool = False) -> int:
    """Rough activation bytes a Llama forward keeps for backward (attention through SDPA).

    Per layer and token about 10·d + 4·ffn values: the inputs of the two norms and of the
    q, k, v and o projections, the rotary outputs, the attention output, and the gated MLP's
    gate, up, activation and product (4 × the intermediate size: the MLP dominates). With
    every layer checkpointed only each layer's input (d values) stays. The float32 logits
    for the loss (V per token) come on top, checkpointing or not.
    """
    d, ffn, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token_layer = d if checkpointed else 10 * d + 4 * ffn
    tokens = batch * seq
    return tokens * (layers * per_token_layer * dtype_bytes + config.vocab_size * 4)


class SavedTensorMeter:
    """Count the bytes autograd saves for backward inside a ``with`` block.

    Each storage is counted once (many ops save the same tensor), and parameters are left
    out: they are weights, not activations. ``meter.bytes`` after the block is the
    activation memory a backward would need.
    """

    def __init__(self, exclude: nn.Module | None = None):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
        self.storages: dict[int, int] = {}
        self._extent: dict[int, tuple[int, int]] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in self.exclude or s.device.type == "meta":
            return t
        # The bytes this view spans. A saved slice of a big tensor (a batch cut from a whole
        # data set) keeps the storage alive, but only its span is this step's activation.
        start = t.storage_offset() * t.element_size()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        lo, hi = self._extent.get(ptr, (start, start))
        self._extent[ptr] = (min(lo, start), max(hi, start + span * t.element_size()))
        self.storages[ptr] = min(self._extent[ptr][1] - self._extent[ptr][0], s.nbytes())
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def activation_bytes(model: nn.Module, forward) -> int:
    """Bytes saved for backward by ``forward()`` (a callable that runs the model), parameters excluded."""
    with SavedTensorMeter(exclude=model) as meter:
        out = forward()
    del out
    return meter.bytes


def tensor_bytes(tensors) -> int:
    """Total bytes of an iterable of tensors (None entries skipped, shared storage counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of weights, gradients and optimizer states, from the tensors themselves."""
    params = list(model.parameters())
    states = [v for s in (optimizer.state.values() if optimizer else []) for v in s.values()
              if torch.is_tensor(v) and v.dim() > 0]  # skip Adam's scalar step counters
    out = {"weights": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
           "optimizer states": tensor_bytes(states)}
    out["total"] = sum(out.values())
    return out


class PeakMemory:
    """Peak GPU memory allocated inside a ``with`` block (CUDA and ROCm); None on CPU."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base


def seed003_table(config, dtypes=("float32", "float16"), model_class: str = "AutoModel") -> list[dict]:
    """Seed 003's memory table (accelerate's estimator) computed offline from a config.

    The model is built on the meta device (``init_empty_weights``), so even 70B costs no
    memory; sizes come from ``accelerate.utils.calculate_maximum_sizes`` and the per-stage
    rule of ``accelerate estimate-memory`` (batch size 1, Adam, activations not counted).
    """
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    import transformers

    with init_empty_weights():
        model = getattr(transformers, model_class).from_config(config)
    total_size, _ = calculate_maximum_sizes(model)
    rows = []
    for dt in dtypes:
        use = estimate_training_usage(total_size, dt)
        rows.append({"dtype": dt, "Model": total_size, "Gradients": use["gradients"],
                     "Backward pass": use["optimizer"], "Optimizer step": use["step"],
                     "Highest": max(use.values())})
    return rows


def format_bytes(n: float | None, unit: str | None = None) -> str:
    """Binary units, as accelerate prints them (its "MB" and "GB" are MiB and GiB)."""
    if n is None:
        return "n/a"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = units.index(unit) if unit else 0
    if unit is None:
        while abs(n) >= 1024 and i < len(units) - 1:
            n, i = n / 1024, i + 1
    else:
        n = n / 1024**i
    return f"{n:.2f} {units[i]}"


class SavedTensorBreakdown(SavedTensorMeter):
    """A ``SavedTensorMeter`` that also sorts the saved bytes by dtype (``meter.by_dtype``).

    Under autocast the split shows what a single "bytes per value" estimate misses: float32
    tensors (the residual stream, norm inputs, logits for the loss) next to 16-bit ones,
    and the 16-bit copies of the weights that autocast makes and keeps for backward.
    """

    def __init__(self, exclude: nn.Module | None = None):
        super().__init__(exclude)
        self.dtypes: dict[int, str] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.storages:
            self.dtypes[t.untyped_storage().data_ptr()] = str(t.dtype).removeprefix("torch.")
        return super()._pack(t)

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, n in self.storages.items():
            out[self.dtypes[ptr]] = out.get(self.dtypes[ptr], 0) + n
        return out


def measure_training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
                          amp_dtype: str | torch.dtype = torch.float32,
                          loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict:
    """One forward, backward and optimizer step, with the memory of each part measured.

    Returns bytes of ``weights``, ``gradients`` and ``optimizer states`` (the tensors
    themselves, read after the step, before the gradients are freed), their ``total``,
    ``activations`` (what autograd saved for backward during the forward, parameters
    excluded) and ``activations by dtype``. On a GPU also ``peak allocated`` (the caching
    allocator's peak over the step, weights included; ``PeakMemory``), ``peak reserved``
    (what the allocator held from the driver: cached and fragmented blocks too) and
    ``device used`` (the whole GPU's used memory after the step: context, libraries'
    workspaces, other processes); those three are None on a CPU, which has no such counters.
    The gradients stay in ``.grad`` (``optimizer.zero_grad()`` frees them).
    """
    from course_lib.precision import autocast
    from course_lib.train import forward_loss

    loss_fn = loss_fn or forward_loss
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    optimizer.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    with PeakMemory(device) as peak:
        with SavedTensorBreakdown(exclude=model) as meter:
            with autocast(device, amp_dtype):
                loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
    out: dict = model_state_bytes(model, optimizer)
    out["activations"] = meter.bytes
    out["activations by dtype"] = meter.by_dtype
    out["peak allocated"] = before + peak.peak if cuda else None
    out["peak reserved"] = torch.cuda.max_memory_reserved(device) if cuda else None
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out["device used"] = total - free
    else:
        out["device used"] = None
    return out


def estimator_rows(model_bytes: int, dtypes=("float32", "float16")) -> list[dict]:
    """Seed 003's per-stage rule (``accelerate estimate-memory``) applied to a model size in bytes.

    The same rows as ``seed003_table`` gives for a config, for a size you adjust by hand
    (for example to add buffers an older library version registered).
    """
    from accelerate.commands.estimate import estimate_training_usage

    rows = []
    for dt in dtypes:
        use = estimate_training_usage(int(model_bytes), dt)
        rows.append({"dtype": dt, "Model": int(model_bytes), "Gradients": use["gradients"],
                     "Backward pass": use["optimizer"], "Optimizer step": use["step"], "Highest": max(use.values())})
    return rows
