"""ZeRO-Offload by hand: the model states on the host while the GPU computes, and the host's optimizer step timed
(notebook 10).

``OffloadedAdamW`` is offload's optimizer by hand: fp32 masters on the host, each gradient sent down during
backward; it is notebook 10's exercise (a stub in the student edition). ``time_cpu_adam`` times DeepSpeed's CPU Adam
against torch's AdamW on the host, the step ZeRO-Offload runs there, and ``nvme_offload_available`` says whether
ZeRO-Infinity can reach an NVMe drive here. Where each state lives and what crosses the link per step is
``course_lib.parallel.offload_cost``; DeepSpeed's offload is a ZeRO config, ``course_lib.parallel.zero_deepspeed``'s
(where its engine holds each state is ``zero_deepspeed.engine_placement``'s reading). How much bigger a model
offload lets a GPU train is ``size_sweep``'s question.
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
