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
activation memory by definition, and ``tensor_bytes`` sums the tensors that hold
weights, gradients and optimizer states. Both are the course's only counters: every
notebook and every parallel technique measures with them (a sharded tensor counts the
shard this rank holds).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.data import to_device
from course_lib.device import compute_device
from course_lib.loss import forward_loss
from course_lib.precision import autocast, dtype_bytes


def training_bytes_per_param(weight_dtype: str = "float32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per parameter for weights, gradients and optimizer states."""
    states = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(states)}")
    b = dtype_bytes(weight_dtype, "weight_dtype")
    return {"weights": b, "gradients": b, "optimizer states": states[optimizer] * b}


def estimate_model_state(n_params: int, weight_dtype: str = "float32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes of weights, gradients and optimizer states for ``n_params`` parameters."""
    per = training_bytes_per_param(weight_dtype, optimizer)
    out = {k: v * n_params for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


def layer_activation_values(config) -> int:
    """Values one Llama layer keeps per token for backward: about 10·d + 4·ffn (see ``llama_activation_bytes``)."""
    return 10 * config.hidden_size + 4 * config.intermediate_size


def llama_activation_bytes(config, batch: int, seq: int, dtype_bytes: int = 4, checkpointed: bool = False,
                           logits_bytes: int = 4, recomputing: bool = False) -> int:
    """Rough activation bytes a Llama forward keeps for backward (attention through SDPA).

    Per layer and token about 10·d + 4·ffn values: the inputs of the two norms and of the
    q, k, v and o projections, the rotary outputs, the attention output, and the gated MLP's
    gate, up, activation and product (4 × the intermediate size: the MLP dominates). With
    every layer checkpointed only each layer's input (d values) stays. The logits for the
    loss (V per token, ``logits_bytes`` each: float32 for the plain loss) come on top,
    checkpointing or not; ``logits_bytes=0`` leaves them out for a loss that counts its own.
    ``recomputing=True`` (with ``checkpointed``) gives the peak in backward, where one layer's activations exist
    again while it is recomputed.
    """
    layers, tokens = config.num_hidden_layers, batch * seq
    per_token_layer = config.hidden_size if checkpointed else layer_activation_values(config)
    again = layer_activation_values(config) if checkpointed and recomputing else 0
    return tokens * ((layers * per_token_layer + again) * dtype_bytes + config.vocab_size * logits_bytes)


class LargestTensor(TorchDispatchMode):
    """Within the ``with`` block, the largest tensor any op creates: ``numel`` and ``shape``.

    Every op torch dispatches passes through, inside custom autograd functions too, and backward as well where it
    runs on this thread (on a CPU it does). What a loss's peak memory is made of, op by op: the plain
    cross-entropy's whole (tokens, V) logits, or a chunked loss's (chunk, V).
    """

    def __init__(self):
        super().__init__()
        self.numel, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


class SavedTensorMeter:
    """Count the bytes autograd saves for backward inside a ``with`` block.

    Each storage counts once (many ops save the same tensor), for the span of it that the saved
    views cover: a batch sliced from a whole data set keeps the data set's storage alive, but
    only the slice is this step's activation. Parameters are left out: they are weights, not
    activations. After the block, ``meter.bytes`` is the activation memory a backward needs,
    ``meter.by_dtype`` splits it by dtype, and ``meter.by_part`` by the ``parts`` given:
    ``(label, module)`` pairs (several modules may share a label, all the MLPs, say), each
    storage charged to the innermost listed module running when autograd first saved it, and
    to ``"other"`` (embedding, loss, ...) when none was. ``meter.live`` is what autograd holds for
    backward right now and ``meter.peak`` the most it held at once (whole storages, each counted from
    its first save until backward frees the last saved view of it), over every block the meter watched.
    """

    def __init__(self, exclude: nn.Module | None = None, parts: Iterable[tuple[str, nn.Module]] = ()):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
        self.parts = list(parts)
        self._running = ["other"]
        self._span: dict[int, tuple[int, int, int]] = {}  # storage -> (first byte, end byte, storage size)
        self._owner: dict[int, tuple[str, str]] = {}  # storage -> (dtype, part) of its first saver
        self.live = self.peak = 0
        self._saved: dict[int, int] = {}  # storage -> saved views autograd still holds

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in self.exclude or s.device.type == "meta":
            return t
        start = t.storage_offset() * t.element_size()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        lo, hi, _ = self._span.get(ptr, (start, start, 0))
        self._span[ptr] = (min(lo, start), max(hi, start + span * t.element_size()), s.nbytes())
        self._owner.setdefault(ptr, (str(t.dtype).removeprefix("torch."), self._running[-1]))
        if ptr not in self._saved:
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
        self._saved[ptr] = self._saved.get(ptr, 0) + 1
        # Autograd keeps what this returns. Not t itself: a saved output (softmax's, say) would then hold its own
        # grad_fn, a cycle through C++ that no garbage collector frees, and every metered forward would leak its
        # activations (on a GPU: out of memory after a few). A detached alias shares t's storage and version counter.
        saved = t.detach()
        weakref.finalize(saved, self._release, ptr, s.nbytes())  # fires when autograd drops what it saved
        return saved

    def _release(self, ptr: int, nbytes: int) -> None:
        self._saved[ptr] -= 1
        if not self._saved[ptr]:
            del self._saved[ptr]
            self.live -= nbytes

    def _enter(self, label: str):
        def hook(module, args) -> None:
            self._running.append(label)
        return hook

    def _leave(self, module, args, out) -> None:  # returns None: a hook that returned something would replace out
        self._running.pop()

    def __enter__(self) -> "SavedTensorMeter":
        self._handles = [h for label, m in self.parts
                         for h in (m.register_forward_pre_hook(self._enter(label)),
                                   m.register_forward_hook(self._leave))]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()

    @property
    def storages(self) -> dict[int, int]:
        """Bytes counted per storage."""
        return {ptr: min(hi - lo, size) for ptr, (lo, hi, size) in self._span.items()}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _grouped(self, which: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, n in self.storages.items():
            key = self._owner[ptr][which]
            out[key] = out.get(key, 0) + n
        return out

    @property
    def by_dtype(self) -> dict[str, int]:
        return self._grouped(0)

    @property
    def by_part(self) -> dict[str, int]:
        return {label: 0 for label, _ in self.parts} | {"other": 0} | self._grouped(1)


def _metered(model: nn.Module, forward: Callable[[], object], parts=()) -> SavedTensorMeter:
    """A meter that watched one ``forward()``; the graph (and with it the saved tensors) is freed after."""
    with SavedTensorMeter(exclude=model, parts=parts) as meter:
        out = forward()
    del out
    return meter


def activation_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes saved for backward by ``forward()`` (a callable that runs the model), parameters excluded."""
    return _metered(model, forward).bytes


def saved_bytes_by_dtype(model: nn.Module, forward: Callable[[], object]) -> dict[str, int]:
    """``activation_bytes`` split by dtype: which activations autocast really stores in 16 bits and which
    stay wider (float32 normalisation statistics, int64 max-pool indices)."""
    return _metered(model, forward).by_dtype


def saved_bytes_by_part(model: nn.Module, forward: Callable[[], object],
                        parts: Iterable[tuple[str, nn.Module]]) -> dict[str, int]:
    """``activation_bytes`` split by the part of the model that saved them (``SavedTensorMeter``'s ``parts``)."""
    return _metered(model, forward, parts).by_part


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes these tensors hold on this rank, each counted once.

    A tensor met twice (a tied weight, a view of the same elements) counts once; a sharded tensor
    (a DTensor: FSDP2's parameters, their gradients and Adam states) counts the shard this rank
    holds; None and 0-dim tensors (Adam's step counters) are skipped.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.dim() == 0:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        key = (id(t) if t.device.type == "meta" else
               (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (Adam's m and v) this rank holds: the whole model's in one process or
    under DDP, a 1/N shard under FSDP and ZeRO (DeepSpeed wraps the torch optimizer: its ``.optimizer``)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return tensor_bytes(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v))


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of weights, gradients and optimizer states, from the tensors themselves."""
    params = list(model.parameters())
    out = {"weights": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
           "optimizer states": optimizer_state_bytes(optimizer) if optimizer is not None else 0}
    out["total"] = sum(out.values())
    return out


class GradientMeter:
    """The peak bytes of gradients a model holds while backward runs, on any device (a CPU too).

    It hooks every parameter (``register_post_accumulate_grad_hook``); each time one gradient is complete it adds
    up the gradients the model's parameters hold at that moment. Attach it before an optimizer that registers
    hooks of its own (ZeRO-Offload's sends each gradient away and frees it): hooks run in the order they were
    registered, so the meter sees every gradient once before it can leave. ``peak`` is the largest sum seen,
    ``after`` what the parameters held when the last backward ended.
    """

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.peak = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._count)

    def _count(self, _param: torch.Tensor) -> None:
        self.peak = max(self.peak, tensor_bytes(p.grad for p in self.params))

    @property
    def after(self) -> int:
        return tensor_bytes(p.grad for p in self.params)


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
    import transformers
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes

    with init_empty_weights():
        model = getattr(transformers, model_class).from_config(config)
    total_size, _ = calculate_maximum_sizes(model)
    return estimator_rows(total_size, dtypes)


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


def measure_training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, *,
                          amp_dtype: str | torch.dtype = torch.float32,
                          loss_fn: Callable[[nn.Module, object], torch.Tensor] = forward_loss) -> dict:
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
    device = compute_device(model)
    batch = to_device(batch, device)
    optimizer.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    with PeakMemory(device) as peak:
        with SavedTensorMeter(exclude=model) as meter:
            with autocast(device, amp_dtype):
                loss = loss_fn(model, batch)
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
