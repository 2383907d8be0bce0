"""Notebook 10's visible test: ZeRO-Offload's step by hand (``OffloadedAdamW``) on a bf16 model, against torch's
AdamW stepping fp32 copies with the same gradients.

The probe runs the student's class on the notebook's device and sends back plain data (the gradients a twin without
hooks computed each step, how many gradients the model held as each one was complete, what landed in the masters,
the masters, the parameters and AdamW's states); the judge replays the gradients through torch's AdamW.
"""

from __future__ import annotations

import copy
import functools

import torch

from course_grader.checks import register, tensor_data
from course_grader.grading import forbid
from course_lib.parallel import offload

OFFLOADED = (offload.OffloadedAdamW,)  # course_lib's, out of reach


def tiny_model(dtype: torch.dtype, frozen: bool, device="cpu", seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4),
                                torch.nn.Linear(4, 4)).to(device, dtype)  # the last layer: unused on request
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def one_thread(fn):
    """``fn`` run on one CPU thread, as the ranks run: the grader's fork of a server cannot start a thread pool
    (a CPU matmul in bf16 there waits forever on a pool the fork did not inherit)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return run


def count_held(params: list) -> list:
    """Hooks on ``params``, registered after the student's (torch runs them in that order): each time a gradient is
    complete, the list returned gets how many of ``params`` hold a gradient once the student's hook has run. Offload
    frees each gradient as it is sent down, so the count stays at most 1; it reaches every parameter where they are
    freed only after backward. It means the same on a CPU, where the model and the masters share one memory."""
    held = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: held.append(sum(q.grad is not None for q in params)))
    return held


def landed_grads(opt, device: torch.device) -> list:
    """The masters' gradients as data, once every copy down has landed (from a GPU they are non-blocking)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [tensor_data(getattr(m, "grad", None), torch.float32) for m in opt.master]


def twin_grads(twin: torch.nn.Module, loss) -> list:
    """The gradients a plain backward leaves on ``twin`` (a copy without the student's hooks), then cleared."""
    loss(twin).backward()
    out = [tensor_data(p.grad, torch.float32) for p in twin.parameters() if p.requires_grad]
    twin.zero_grad(set_to_none=True)
    return out


@one_thread
def offload_probe(ns: dict, dtype_name: str, lr: float, steps: int, frozen: bool = False, unused: bool = False,
                  seed: int = 0, data_seed: int = 1) -> dict:
    """The student's OffloadedAdamW on the small model (the weights of ``seed``) in ``dtype`` on the notebook's device,
    ``steps`` steps on the input of ``data_seed``: per step the gradients a twin without hooks computed (what the
    reference AdamW replays), how many gradients the model held as each one was complete in backward, which it still
    held after backward, and what landed in the masters; then the masters, the parameters and AdamW's states."""
    device, dtype = ns["device"], DTYPES[dtype_name]
    model = tiny_model(dtype, frozen, device, seed)
    twin = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with forbid(*OFFLOADED, namespace=ns):
        opt = ns["OffloadedAdamW"](model.parameters(), lr=lr, weight_decay=0.01, offload_device="cpu")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(data_seed)).to(device, dtype)
    grads, held, kept, landed = [], [], [], []
    during = count_held(trainable)  # after the student's hooks
    for s in range(steps):
        loss = lambda m, s=s: ((m[:3](x) if unused else m(x)).float() - 0.1 * s).pow(2).mean()  # noqa: E731
        twin.load_state_dict(model.state_dict())  # the same weights: the gradients this step must send down
        grads.append(twin_grads(twin, loss))
        with forbid(*OFFLOADED, namespace=ns):
            loss(model).backward()
            held.append(during.copy())
            during.clear()
            kept.append([p.grad is not None for p in trainable])
            landed.append(landed_grads(opt, device))
            opt.step()
            opt.zero_grad(set_to_none=True)
    masters = [{"dtype": str(m.dtype), "device": m.device.type, "value": m.detach().cpu().clone()} for m in opt.master]
    trained = [{"dtype": str(p.dtype), "device": p.device.type, "grad_is_none": p.grad is None,
                "value": p.detach().cpu().clone()} for p in trainable]
    states = [{k: [str(st[k].dtype), st[k].device.type] if k in st else None for k in ("exp_avg", "exp_avg_sq")}
              for st in opt.optimizer.state.values()]
    return {"device": device.type, "grads": grads, "held": held, "kept": kept, "landed": landed, "masters": masters,
            "trainable": trained, "states": states, "model": [p.detach().cpu().clone() for p in model.parameters()]}


def judge_sent_down(got: dict) -> None:
    """After each backward no parameter holds a gradient, and each master holds its parameter's, in fp32; during it
    the model held at most one gradient at a time (the one being sent down)."""
    for step, (held, kept, landed, want) in enumerate(zip(got["held"], got["kept"], got["landed"], got["grads"])):
        still = [i for i, k in enumerate(kept) if k]
        assert not still, (f"step {step}: parameters {still} still hold their gradient after backward: send each one "
                           "down in a post-accumulate-grad hook and free it there (p.grad = None)")
        complete = sum(w is not None for w in want)
        assert len(held) == complete, \
            f"step {step}: {len(held)} gradients were complete in backward, the model's parameters got {complete}"
        assert max(held, default=0) <= 1, (
            f"step {step}: during backward the model held {max(held)} of its gradients at once: free each one in its "
            "hook, right after sending it down (p.grad = None), so the model never holds more than that one")
        for i, (g, w) in enumerate(zip(landed, want)):
            assert (g is None) == (w is None), \
                f"step {step}, master {i}: .grad is {g!r:.60} where the gradient is {w!r:.60}"
            if w is not None:
                assert isinstance(g, torch.Tensor) and g.shape == w.shape, \
                    f"step {step}, master {i}: .grad is {g!r:.80}"
                gap = ((g - w).abs().max() / w.abs().max().clamp(min=1e-12)).item()
                assert gap < 1e-5, f"step {step}, master {i}: its .grad is {gap:.1e} (relative) from the gradient"


def adamw_replay(grads: list, params: list, lr: float) -> list:
    """fp32 copies of ``params`` stepped by torch's AdamW (weight decay 0.01) with each step's ``grads``."""
    ref = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(ref, lr=lr, weight_decay=0.01)
    for step in grads:
        for r, g in zip(ref, step):
            r.grad = g
        opt.step()
    return ref


def judge_offload(got: dict, dtype_name: str, lr: float, steps: int, frozen: bool = False,
                  unused: bool = False, seed: int = 0) -> list:
    """The masters against torch's AdamW replaying the same gradients on fp32 copies, from the weights of ``seed``;
    returns the starting weights."""
    dtype = DTYPES[dtype_name]
    start = [p.detach().clone() for p in tiny_model(dtype, frozen, seed=seed).parameters()]
    trained = [p for p in tiny_model(dtype, frozen, seed=seed).parameters() if p.requires_grad]
    n = len(trained)
    assert len(got["trainable"]) == n, f"{len(got['trainable'])} trainable parameters after step(), the model has {n}"
    assert len(got["grads"]) == len(got["held"]) == len(got["kept"]) == len(got["landed"]) == steps, \
        f"{len(got['landed'])} steps' gradients in the masters, expected {steps}"
    for step in range(steps):
        assert len(got["grads"][step]) == len(got["kept"][step]) == len(got["landed"][step]) == n, \
            f"step {step}: {len(got['landed'][step])} masters' gradients, the model has {n} trainable parameters"
    model = got["model"]
    assert len(model) == len(start) and all(
        isinstance(p, torch.Tensor) and p.shape == s.shape for p, s in zip(model, start)), \
        "the model's parameters changed in number or shape"
    assert all(torch.isfinite(p.float()).all() for p in model), "the model's weights hold NaN or inf after training"
    with_grads = n - (2 if unused else 0)  # the unused layer's weight and bias get no gradient, so no AdamW state
    assert len(got["states"]) >= with_grads, \
        f"AdamW holds state for {len(got['states'])} masters, but {with_grads} got a gradient in every step"
    ref = adamw_replay(got["grads"], trained, lr)
    masters, trainable = got["masters"], got["trainable"]
    assert len(masters) == len(trainable), f"{len(masters)} masters for {len(trainable)} trainable parameters"
    judge_sent_down(got)
    for i, (p, m, r) in enumerate(zip(trainable, masters, ref)):
        assert m["dtype"] == "torch.float32" and m["device"] == "cpu", \
            f"master {i}: {m['dtype']} on {m['device']}, not fp32 on the CPU"
        assert p["dtype"] == str(dtype) and p["device"] == got["device"], \
            f"parameter {i} is now {p['dtype']} on {p['device']}"
        assert p["grad_is_none"], f"parameter {i} still holds its gradient after step(): free it (p.grad = None)"
        gap = ((m["value"] - r).abs().max() / r.abs().max().clamp(min=1e-12)).item()
        assert gap < 1e-5, f"master {i} is {gap:.1e} (relative) from fp32 AdamW on the same gradients"
        assert torch.equal(p["value"], m["value"].to(dtype)), f"parameter {i} is not its master rounded to {dtype}"
    for st in got["states"]:
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k] == ["torch.float32", "cpu"], f"AdamW's {k} is not fp32 on the CPU"
    return start


def judge_offload_visible(got: dict) -> str:
    start = judge_offload(got, "bfloat16", 1e-3, 5)
    assert any(not torch.equal(p, s) for p, s in zip(got["model"], start)), "the model did not change"
    return (f"{sum(m['value'].numel() for m in got['masters'])} fp32 master weights on the CPU; the model in bf16 on "
            f"{got['device']}")


register("test_OffloadedAdamW", lambda ns: offload_probe(ns, "bfloat16", 1e-3, 5), judge_offload_visible)
