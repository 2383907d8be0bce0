"""ZeRO-Offload and ZeRO-Infinity: the model states on the host (or NVMe) while the GPU computes (notebook 10).

``offload_plan`` says where each model state lives and how many bytes per parameter it takes there, and
``link_bytes_per_step`` what crosses the GPU-host link per step; ``tokens_to_hide`` how many tokens a step must
compute for the link and the CPU optimizer to hide behind it (where a real DeepSpeed engine holds each state is
``deepspeed_engine.engine_placement``'s reading), and ``time_cpu_adam`` times DeepSpeed's CPU Adam against
torch's AdamW on the host. ``OffloadedAdamW`` is offload's optimizer by hand: fp32 masters on the host, each
gradient sent down during backward; it is notebook 10's exercise (a stub in the student edition). How much
bigger a model offload lets a GPU train is ``size_sweep``'s question; the engine and its configs are
``course_lib.parallel.deepspeed_engine``'s.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from course_lib.throughput import time_interleaved


def nvme_offload_available() -> bool:
    """Whether DeepSpeed can build its async I/O op here (ZeRO-Infinity to NVMe needs libaio)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:
        return False


# ------------------------------------------------------------------ ZeRO-Offload, ZeRO-Infinity: where each state lives
# Where each model state lives on one GPU (world_size 1) with bf16 mixed precision, in bytes per parameter, as
# DeepSpeed 0.19.8 keeps it. "pytorch" is plain PyTorch: fp32 weights and gradients under bf16 autocast, AdamW's m, v.
# ZeRO-2 with the optimizer offloaded keeps only the bf16 weights on the GPU: each gradient bucket is reduced,
# copied into an fp32 buffer on the CPU and freed during the backward (the ZeRO-Offload paper's design).
OFFLOAD_STRATEGIES = {
    "pytorch": {"fp32 weights": "GPU", "fp32 gradients": "GPU", "Adam m and v": "GPU"},
    "zero2_offload": {"16-bit weights": "GPU", "fp32 gradients": "CPU", "fp32 master weights": "CPU",
                      "Adam m and v": "CPU"},
    "zero3_offload": {"16-bit weights": "CPU", "fp32 gradients": "CPU", "fp32 master weights": "CPU",
                      "Adam m and v": "CPU"},
    "zero3_nvme": {"16-bit weights": "NVMe", "fp32 gradients": "NVMe", "fp32 master weights": "NVMe",
                   "Adam m and v": "NVMe"},
}
STRATEGY_NAMES = {"pytorch": "PyTorch (AdamW, bf16 autocast)", "zero2_offload": "ZeRO-2 + optimizer offload",
                  "zero3_offload": "ZeRO-3 + parameter offload", "zero3_nvme": "ZeRO-Infinity (NVMe)"}
_STATE_BYTES = {"16-bit weights": 2, "fp32 weights": 4, "fp32 gradients": 4, "fp32 master weights": 4,
                "Adam m and v": 8}


def check_strategy(strategy: str) -> None:
    """Refuse a strategy name that is not one of ``OFFLOAD_STRATEGIES``, listing those that are."""
    if strategy not in OFFLOAD_STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {sorted(OFFLOAD_STRATEGIES)}")


def offload_plan(strategy: str, n_params: int, world_size: int = 1, low_bytes: int = 2) -> list[dict]:
    """Each model state of ``strategy``: where it lives and the bytes one rank holds between steps.

    ``low_bytes`` is the size of DeepSpeed's "16-bit" copy (2 for bf16; 4 when it runs in fp32, as the
    notebook's CPU runs do). The ZeRO strategies shard everything but ZeRO-2's weights over ``world_size``;
    the gradients they keep are the fp32 partition the optimizer steps (the 16-bit ones are transient).
    """
    check_strategy(strategy)
    rows = []
    for state, where in OFFLOAD_STRATEGIES[strategy].items():
        per = low_bytes if state == "16-bit weights" else _STATE_BYTES[state]
        whole = strategy == "pytorch" or (strategy == "zero2_offload" and state == "16-bit weights")
        rows.append({"state": state, "lives on": where, "bytes per parameter": per,
                     "bytes on this rank": per * n_params // (1 if whole else world_size)})
    return rows


def link_bytes_per_step(strategy: str, n_params: int) -> dict[str, int]:
    """Bytes of model state that cross the GPU-host link (and the NVMe drive) in one optimizer step, one GPU.

    ZeRO-2 offload: each gradient goes down once, converted to fp32 on the GPU before the copy (DeepSpeed
    copies into its fp32 CPU buffer; the ZeRO-Offload paper sends 16-bit: 2 bytes), and the updated bf16
    weights come up once. ZeRO-3 offload: the bf16 weights come up twice (forward and backward each gather
    them), the gradients go down in fp32, and the update stays on the CPU. ZeRO-Infinity adds the NVMe
    drive: fp32 master weights, m and v read and written back, bf16 weights read twice and written once.
    Activations and the batch are not counted.
    """
    check_strategy(strategy)
    up, down, nvme_read, nvme_write = {"pytorch": (0, 0, 0, 0), "zero2_offload": (2, 4, 0, 0),
                                       "zero3_offload": (4, 4, 0, 0), "zero3_nvme": (4, 4, 12 + 4, 12 + 2)}[strategy]
    return {"host to GPU": up * n_params, "GPU to host": down * n_params, "NVMe read": nvme_read * n_params,
            "NVMe write": nvme_write * n_params}


def tokens_to_hide(bytes_per_param: float, link_bytes_per_s: float, optimizer_params_per_s: float,
                   gpu_flops: float) -> dict[str, float]:
    """Tokens per step at which the GPU's compute (6 FLOPs per parameter and token) takes as long as the
    offload's link traffic, and as long as the CPU's optimizer step.

    Both costs grow with the parameters N, as the compute does, so N cancels: below these batch sizes
    offload is bound by the link or the CPU, above them by the GPU. This is why offload needs the large
    batch that the memory it frees makes possible (seed 004: "by enabling larger batch sizes").
    """
    return {"link": bytes_per_param / link_bytes_per_s * gpu_flops / 6,
            "CPU optimizer": gpu_flops / (6 * optimizer_params_per_s)}


# graded: 10_zero_offload OffloadedAdamW
class OffloadedAdamW:
    """ZeRO-Offload's optimizer on one device, by hand: the model keeps only its (16-bit) weights; every gradient
    leaves for ``offload_device`` during backward, as soon as backward has produced it, and the fp32 master
    weights, their gradients and AdamW's m and v live there.

    A post-accumulate-grad hook on each parameter sends its gradient down in fp32 (added to what earlier
    micro-batches sent, so accumulation works) and frees it (``p.grad = None``): the model holds at most the one
    gradient being sent, never a whole set, as DeepSpeed's offload moves them bucket by bucket. From a GPU the
    copies are non-blocking into pinned host memory and the hook never waits: a later micro-batch's gradient is
    added to the master's on the GPU and the sum sent down over it, in the stream's order. ``step`` waits once for
    every copy before it steps the masters with torch's AdamW and copies them back up in the model's dtype. Updates
    too small for bf16 accumulate in the fp32 masters, so bf16 weights keep learning (notebook 01). ``master`` and
    ``optimizer`` are public: they are what offload moved.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.01, offload_device: str = "cpu", **adamw):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().to(offload_device, torch.float32, copy=True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, **adamw)
        # pinned host memory and non-blocking copies where a gradient crosses from a GPU to the host
        self.async_copies = any(p.is_cuda for p in self.params) and torch.device(offload_device).type == "cpu"
        for p, m in zip(self.params, self.master):
            p.register_post_accumulate_grad_hook(functools.partial(self._send_down, m))

    def _send_down(self, master: torch.Tensor, p: torch.Tensor) -> None:
        # No wait here: it would stall backward behind each copy. The copies and the add below are queued on the
        # stream in order, and step() waits for them all at once.
        grad, async_copies = p.grad.detach(), self.async_copies
        if master.grad is None:  # the step's first micro-batch
            master.grad = grad.to(master.device, torch.float32, non_blocking=async_copies)
        else:  # a later one: the sum is made on p's device, after the earlier copy down, and sent down over it
            master.grad.copy_(master.grad.to(p.device, non_blocking=async_copies) + grad, non_blocking=async_copies)
        p.grad = None  # the gradient has left the device

    def step(self) -> None:
        if self.async_copies:
            torch.cuda.synchronize()  # the copies down were queued without waiting: AdamW reads them once landed
        self.optimizer.step()  # a master without a gradient (its parameter took no part) is left as it is
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m.grad is not None:
                    p.copy_(m)  # up, cast to the model's dtype
                    m.grad = None  # the next step accumulates afresh

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.params, self.master):
            p.grad = m.grad = None


def time_cpu_adam(n_params: int = 8_000_000, repeat: int = 3, pieces: int = 4, lr: float = 1e-3) -> dict:
    """One optimizer step over ``n_params`` fp32 parameters on the CPU: DeepSpeed's CPU Adam against torch's AdamW.

    This is the step ZeRO-Offload runs on the host. torch's AdamW is timed two ways: its default on the CPU
    (``foreach``: each op over the whole tensor list, one op after the other) and ``fused=True`` (one kernel).
    Every optimizer starts from the same weights and gradients and takes the same steps, taking turns
    (``time_interleaved``), so the final weights also say whether they computed the same update. If DeepSpeed's
    ``cpu_adam`` op cannot build or load here, its entry is None and ``error`` says why.
    """
    if n_params < pieces:
        raise ValueError(f"n_params={n_params} must be at least pieces={pieces}")
    torch.manual_seed(0)
    weights = [torch.randn(n_params // pieces) for _ in range(pieces)]
    grads = [torch.randn_like(w) * 1e-2 for w in weights]

    def params():
        ps = [nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(ps, grads):
            p.grad = g
        return ps

    kw = dict(lr=lr, weight_decay=0.01)
    opts = {"torch AdamW (foreach, default)": torch.optim.AdamW(params(), **kw),
            "torch AdamW (fused=True)": torch.optim.AdamW(params(), fused=True, **kw)}
    error = None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # loads (or JIT-builds) the cpu_adam op

        opts["DeepSpeed CPU Adam"] = DeepSpeedCPUAdam(params(), adamw_mode=True, **kw)
    except Exception as err:  # a missing compiler, an op built for another torch: say so, time the rest
        error = f"DeepSpeed's cpu_adam op did not build or load: {type(err).__name__}: {err}"
    times = time_interleaved({name: opt.step for name, opt in opts.items()}, warmup=1, repeat=repeat)
    reference = [p.detach() for p in opts["torch AdamW (foreach, default)"].param_groups[0]["params"]]
    out = {"n_params": n_params - n_params % pieces, "error": error, "seconds": {}, "max_abs_diff_vs_torch": {}}
    for name in ("torch AdamW (foreach, default)", "torch AdamW (fused=True)", "DeepSpeed CPU Adam"):
        out["seconds"][name] = times[name]["median_s"] if name in times else None
        out["max_abs_diff_vs_torch"][name] = (max((p.detach() - r).abs().max().item() for p, r in
                                                     zip(opts[name].param_groups[0]["params"], reference))
                                                 if name in opts else None)
    return out
