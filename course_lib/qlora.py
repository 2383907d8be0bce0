"""QLoRA: LoRA adapters (``course_lib.lora``, peft) trained on a frozen base stored in NF4 (``course_lib.nf4``).

QLoRA is NF4 under LoRA. ``nf4`` holds the storage format; this module holds what is built and run on it:
- **The layer.** ``QLoRALinear`` keeps only what QLoRA stores (the packed 4-bit codes, the double-quantised
  scales) and dequantises the weight to the input's dtype in every forward; the gradient flows through it to
  the adapters, the base never changes. Notebook 12's exercise, a stub in the student edition.
- **The memory table.** ``memory_table`` gives the bf16-LoRA and QLoRA model state of a Llama shape, the
  layers' shapes read from transformers' own modules (``adapter_parameters``).
- **bitsandbytes.** Whether its 4-bit NF4 path imports (``bitsandbytes_error``) and computes what it should
  on a device (``bitsandbytes_4bit_runs``, ``qlora_support``: what the preflight and notebook 12 decide from).
- **The fine-tune.** On a GPU, ``compare_qlora`` fine-tunes the same model twice through transformers'
  ``BitsAndBytesConfig`` and peft, bf16 LoRA and then QLoRA. bitsandbytes is imported only inside functions.

Importing this module quiets a log line bitsandbytes writes on import (see below): import it before peft.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import tempfile

import torch
from torch import nn

from course_lib.data import lm_batch
from course_lib.device import free_memory
from course_lib.lora import ALL_LINEAR, apply_lora
from course_lib.memory import PeakMemory, SavedTensorMeter
from course_lib.models import build_llama, llama_num_parameters
from course_lib.nf4 import (BLOCKSIZE, bits_per_parameter, compress_absmax, decompress_absmax,
                            dequantize_nf4, nf4_code, quantize_nf4, quantized_linears, relative_rms_error)
from course_lib.train import fit, tokens_per_second

QLORA_TARGETS = ALL_LINEAR  # QLoRA puts adapters on every linear layer of a block (lora's own list)
INSTALL_BITSANDBYTES = ("pip install bitsandbytes (a build for your GPU stack: CUDA wheels come from PyPI; "
                        "for ROCm see bitsandbytes' installation guide)")
# bitsandbytes logs a warning on import on CPUs with AVX512-bf16 (an optional CPU kernel package is missing).
# It lands on stderr, and nbgrader scores a test cell that writes to stderr 0: peft imports bitsandbytes
# whenever it is installed, so the notebook that imports this module must not see that line.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


# graded: 12_qlora QLoRALinear
class DequantizedLinear(torch.autograd.Function):
    """``x @ W.T`` for the NF4 weight ``W`` of a ``QLoRALinear``, which autograd never keeps.

    A plain ``F.linear(x, W)`` saves ``W`` for the input's gradient: one dequantised weight per layer, alive from
    forward to backward, which is the memory QLoRA exists to save. Here forward dequantises ``W``, uses it and lets
    it go; backward dequantises it again from the layer's buffers (bitsandbytes' ``MatMul4Bit`` does the same).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QLoRALinear") -> torch.Tensor:
        ctx.layer = layer  # its buffers, which it holds anyway: no tensor is saved for backward
        return nn.functional.linear(x, layer.dequantized_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return grad_y @ ctx.layer.dequantized_weight(grad_y.dtype), None  # the layer takes no gradient


# graded: 12_qlora QLoRALinear
class QLoRALinear(nn.Module):
    """QLoRA's layer: ``base``'s weight stored in NF4, dequantised on the fly in every forward, beside LoRA adapters
    of rank ``r`` (``lora_A``, ``lora_B``: the only parameters that train; ``B`` starts at zero).

    It keeps no float copy of the weight. Its buffers are what QLoRA stores: ``packed`` (uint8, two codes a byte),
    ``absmax_codes`` (uint8), ``absmax_scales`` and ``absmax_offset`` (float32), ``stored_bytes`` in all; the bias,
    if any, stays as it was, frozen. Each forward dequantises the weight to the input's dtype (bf16 under autocast,
    QLoRA's compute dtype) through ``DequantizedLinear``, and backward again: autograd saves no weight, the
    gradient flows to the input and the adapters, the base never changes.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, blocksize: int = BLOCKSIZE):
        super().__init__()
        self.shape, self.blocksize = tuple(base.weight.shape), blocksize
        packed, absmax = quantize_nf4(base.weight, blocksize)
        self.register_buffer("packed", packed)
        for name, part in zip(("absmax_codes", "absmax_scales", "absmax_offset"), compress_absmax(absmax)):
            self.register_buffer(name, part)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        kw = dict(bias=False, device=base.weight.device)
        self.lora_A, self.lora_B = nn.Linear(base.in_features, r, **kw), nn.Linear(r, base.out_features, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the buffers hold, in ``dtype``: made anew at every call, never kept."""
        absmax = decompress_absmax(self.absmax_codes, self.absmax_scales, self.absmax_offset)
        return dequantize_nf4(self.packed, absmax, self.shape, self.blocksize, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = DequantizedLinear.apply(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of ``layer(x)`` under bf16 autocast, beyond the layer's own
    parameters and buffers (held anyway): what the layer adds to the activation memory until backward."""
    meter = SavedTensorMeter(exclude=layer)
    meter.exclude |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
    with meter, torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = layer(x)
    del y
    return meter.bytes


def _quantized_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer QLoRA quantises in a Llama of ``config``, by module name: read from
    transformers' own modules, built on the meta device (no storage: a tenth of a second for 70B)."""
    from transformers import LlamaForCausalLM  # heavy: only when a table is asked for

    with torch.device("meta"):
        model = LlamaForCausalLM(copy.deepcopy(config))  # a copy: transformers writes into the config it is given
    return {name: (m.in_features, m.out_features) for name, m in quantized_linears(model).items()}


def adapter_parameters(config, r: int = 16, targets: tuple[str, ...] = QLORA_TARGETS) -> int:
    """LoRA's trainable parameters on a Llama of ``config``: r·(in + out) for every linear layer named in
    ``targets``, the shapes read from transformers' own modules (as peft finds them), not from a formula."""
    shapes = _quantized_shapes(config)
    kinds = sorted({name.rsplit(".", 1)[-1] for name in shapes})  # q_proj, ..., down_proj
    if unknown := set(targets) - set(kinds):
        raise ValueError(f"targets {sorted(unknown)} are not linear layers of a Llama; use some of {kinds}")
    return sum(r * (i + o) for name, (i, o) in shapes.items() if name.rsplit(".", 1)[-1] in targets)


def memory_table(config, r: int = 16, targets: tuple[str, ...] = QLORA_TARGETS, blocksize: int = BLOCKSIZE,
                 double_quant: bool = True) -> dict[str, dict[str, float]]:
    """Model state in bytes of a LoRA fine-tune of a Llama ``config``: bf16 base vs NF4 base (QLoRA).

    Base: bf16 LoRA keeps every weight in 2 bytes; QLoRA stores the decoder's linear layers in
    ``bits_per_parameter`` bits and the rest (embeddings, norms, LM head) in bf16. Adapters of rank ``r``
    on ``targets`` in every layer, the same for both: fp32 weights (4 bytes) with fp32 gradients (4) and
    AdamW's two moments (8). Activations come on top and are the same for both (they grow with batch × sequence).
    """
    shapes = _quantized_shapes(config)
    total = llama_num_parameters(config)
    linear = sum(i * o for i, o in shapes.values())
    adapters = adapter_parameters(config, r, targets)
    nf4_bytes = linear * bits_per_parameter(blocksize, double_quant) / 8 + (total - linear) * 2
    rows = {"bf16 LoRA": {"base weights": 2.0 * total}, "QLoRA (NF4)": {"base weights": nf4_bytes}}
    for row in rows.values():
        row.update({"adapters (fp32)": 4.0 * adapters, "adapter gradients + AdamW": 12.0 * adapters})
        row["total"] = sum(row.values())
    return rows


def bitsandbytes_error() -> str | None:
    """None if bitsandbytes imports here; otherwise why not, with the command that installs it."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"bitsandbytes is not installed: {INSTALL_BITSANDBYTES}"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # a build for another GPU stack fails at import with many error types
        return f"bitsandbytes is installed but does not import ({type(err).__name__}: {err}): {INSTALL_BITSANDBYTES}"
    return None


PROBE_TOLERANCE = 0.02  # relative RMS: bf16 rounding of a right answer is ~0.4%; a wrong kernel is off by far more
NF4_ERROR_BOUND = 0.15  # relative RMS of NF4 itself on normal weights is ~0.1; a weight out of place is ~1 (or nan)


def nf4_exact_weight(rows: int, cols: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A float32 weight that NF4 stores exactly: each block of ``BLOCKSIZE`` values is NF4 levels times one
    scale, and holds the level 1.0 once (so the scale is its absmax). Its round trip is the weight itself,
    to the precision its scale is stored in: a reference that needs no quantiser."""
    n = rows * cols
    if n % BLOCKSIZE:
        raise ValueError(f"rows x cols = {n} is not a multiple of {BLOCKSIZE}: pick whole blocks")
    blocks = torch.randint(0, 16, (n // BLOCKSIZE, BLOCKSIZE), generator=generator)
    blocks[:, 0] = 15  # the level 1.0 in every block ...
    blocks = blocks[:, torch.randperm(BLOCKSIZE, generator=generator)]  # ... somewhere in it
    scales = 0.01 * (1 + torch.rand(n // BLOCKSIZE, 1, generator=generator))  # scales of neighbouring blocks: within 2x
    return (nf4_code()[blocks] * scales).reshape(rows, cols)


@functools.lru_cache(maxsize=None)
def bitsandbytes_4bit_runs(device: str = "cuda") -> str | None:
    """None if bitsandbytes' 4-bit NF4 path runs on ``device`` and computes what it should; else why not.

    An installed bitsandbytes can import and still have no kernels for this GPU stack (a CUDA wheel on
    ROCm, a build for another CUDA): then ``from_pretrained`` fails mid-cell. So this runs what QLoRA
    runs, once, on a 64×64 bf16 weight: ``quantize_4bit`` (NF4, double quantisation), ``dequantize_4bit``,
    and ``matmul_4bit`` forward and backward. The weight is one NF4 stores exactly (``nf4_exact_weight``), so
    the dequantised weight must be the weight, and the product ``x @ dequantised.T``, to ``PROBE_TOLERANCE``.
    Remembered per device; the same contract as ``fp8_compute.scaled_mm_runs``: what a preflight calls.
    """
    if error := bitsandbytes_error():
        return error
    try:
        from bitsandbytes import functional as bnb_functional
        from bitsandbytes import matmul_4bit

        g = torch.Generator().manual_seed(0)
        w = nf4_exact_weight(64, 64, g).to(device, torch.bfloat16)
        x = torch.randn(4, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
        q, state = bnb_functional.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=True)
        back = bnb_functional.dequantize_4bit(q, state).float().cpu()
        y = matmul_4bit(x, q.t(), quant_state=state)
        y.float().sum().backward()
        y, grad = y.detach().float().cpu(), x.grad.float().cpu()
    except Exception as err:  # noqa: BLE001 (a missing kernel raises anything from AssertionError to a CUDA error)
        first = (str(err).splitlines() or [""])[0][:200]
        return (f"bitsandbytes imports but its 4-bit kernels do not run on {device} ({type(err).__name__}: {first}): "
                f"{INSTALL_BITSANDBYTES}")
    return _probe_mismatch(device, w.float().cpu(), x.detach().float().cpu(), back, y, grad,
                           weight_tolerance=PROBE_TOLERANCE)


def _probe_mismatch(device: str, w: torch.Tensor, x: torch.Tensor, back: torch.Tensor, y: torch.Tensor,
                    grad: torch.Tensor, weight_tolerance: float = NF4_ERROR_BOUND) -> str | None:
    """Why bitsandbytes' probe results are wrong (weights, product or gradient), or None when they are right.

    The dequantised weight ``back`` must be within ``weight_tolerance`` of ``w`` (relative RMS): NF4's own error
    for any weight, ``PROBE_TOLERANCE`` for one that NF4 stores exactly (``nf4_exact_weight``).
    """
    errors = {"dequantised weight": relative_rms_error(back, w),
              "matmul_4bit output": relative_rms_error(y, x @ back.t()),
              "matmul_4bit input gradient": relative_rms_error(grad, torch.ones_like(y) @ back)}
    tolerance = {"dequantised weight": weight_tolerance}
    wrong = {k: v for k, v in errors.items() if not v <= tolerance.get(k, PROBE_TOLERANCE)}  # nan is wrong too
    if wrong:
        return (f"bitsandbytes' 4-bit kernels run on {device} but compute wrong values (relative error "
                + ", ".join(f"{k} {v:.2g}" for k, v in wrong.items()) + f"): {INSTALL_BITSANDBYTES}")
    return None


def qlora_support(device: torch.device | str) -> str | None:
    """None where ``compare_qlora`` can run on ``device``; otherwise what it needs, in words.

    On a GPU that is bitsandbytes' 4-bit path really running there (``bitsandbytes_4bit_runs``), not
    only importing."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"the QLoRA comparison measures GPU memory and speed, so it needs a GPU (CUDA or ROCm) with "
                f"bitsandbytes; this notebook runs on {device.type}")
    return bitsandbytes_4bit_runs(str(device))


def bnb_config(compute_dtype: torch.dtype = torch.bfloat16, double_quant: bool = True):
    """transformers' ``BitsAndBytesConfig`` for QLoRA: 4-bit NF4 base, double quantisation, bf16 compute."""
    from transformers import BitsAndBytesConfig

    if error := bitsandbytes_error():
        raise ImportError(error)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def save_random_llama(preset: str, path: str, seed: int = 0, **overrides) -> str:
    """A Llama of ``preset`` (``overrides`` such as ``intermediate_size=256``) with random weights saved in bf16
    under ``path`` (for ``from_pretrained``)."""
    model = build_llama(preset, seed=seed, **overrides)
    model.config._attn_implementation = "sdpa"  # the saved config must load without course_lib's attention
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    return path


def load_lora_model(path: str, *, quantize: bool, device: torch.device | str, r: int = 16, alpha: int = 32,
                    seed: int = 0) -> nn.Module:
    """The checkpoint at ``path`` with LoRA adapters (peft) on ``QLORA_TARGETS``: its base in bf16, or,
    with ``quantize``, in NF4 through ``BitsAndBytesConfig`` (QLoRA). Adapters start from ``seed``."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": device},
        quantization_config=bnb_config() if quantize else None)
    model.config.use_cache = False
    torch.manual_seed(seed)
    return apply_lora(model, r=r, alpha=alpha, target_modules=QLORA_TARGETS)


def lora_run(path: str, *, quantize: bool, steps: int, batch: int, seq: int, device: torch.device | str,
             lr: float = 1e-4, warmup: int = 2, seed: int = 0, **lora) -> dict:
    """Load ``path`` for LoRA (``load_lora_model``) and train ``steps`` steps of bf16 autocast on ``lm_batch`` rows.

    Returns every step's loss, tokens/s over the steps after ``warmup``, the memory the loaded model holds
    (``weights_bytes``: base and adapters) and the peak memory of the whole run (GPU only; None on a CPU).
    """
    device = torch.device(device)
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}: the first steps are not timed")
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    with PeakMemory(device) as peak:
        model = load_lora_model(path, quantize=quantize, device=device, seed=seed, **lora)
        weights = torch.cuda.memory_allocated(device) - before if before is not None else None
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=device.type == "cuda")
        vocab = model.config.vocab_size
        history = fit(model, opt, lambda step: lm_batch(step, batch, seq, vocab, seed).to(device), steps,
                      amp_dtype=torch.bfloat16, progress=False)
        del model, opt
    free_memory(device)
    return {"losses": [r["loss"] for r in history], "tokens_per_s": tokens_per_second(history, batch * seq, warmup),
            "weights_bytes": weights, "peak_bytes": peak.peak, "quantized": quantize}


def compare_qlora(model_name: str | None = None, *, preset: str = "1b", steps: int, batch: int, seq: int,
                  device: torch.device | str, seed: int = 0, **kwargs) -> dict[str, dict]:
    """bf16 LoRA, then QLoRA, from the same checkpoint on the same batches (``lora_run`` twice).

    ``model_name`` (a hub name or a folder) is loaded as it is; without it a ``preset`` Llama with random
    weights is saved to a temporary folder first. Stops first, with what is missing, where
    ``qlora_support`` says QLoRA cannot run.
    """
    if why_not := qlora_support(device):
        raise RuntimeError(why_not)
    with tempfile.TemporaryDirectory(prefix="qlora_") as tmp:
        path = model_name or save_random_llama(preset, tmp, seed)
        kw = dict(steps=steps, batch=batch, seq=seq, device=device, seed=seed, **kwargs)
        return {"bf16 LoRA": lora_run(path, quantize=False, **kw), "QLoRA (NF4)": lora_run(path, quantize=True, **kw)}
