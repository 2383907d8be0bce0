"""Known submissions of 10_zero_offload and the scores nbgrader's autograde must give them.

Each case replaces the named solution cell of the solution notebook; every other solution cell keeps the reference
solution. ``scores`` gives the expected points of every graded cell.
"""

# --- OffloadedAdamW (ZeRO-Offload's step by hand): the reference, and the mistakes students make

_OFFLOAD_INIT = '''
class OffloadedAdamW:
    def __init__(self, params, lr=1e-3, weight_decay=0.01, offload_device="cpu"):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().to(offload_device, torch.float32, copy=True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
'''

OFFLOADED = _OFFLOAD_INIT + '''        for p, m in zip(self.params, self.master):
            p.register_post_accumulate_grad_hook(lambda p, m=m: self._send_down(p, m))

    def _send_down(self, p, m):
        if m.grad is None:
            m.grad = p.grad.detach().to(m.device, torch.float32)
        else:
            m.grad += p.grad.detach().to(m.device, torch.float32)
        p.grad = None

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m.grad is not None:
                    p.copy_(m)
                    m.grad = None

    def zero_grad(self, set_to_none=True):
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None
'''

# the contract before gradients left during backward: every gradient stays on the model until step() sends it down
OFFLOAD_AT_STEP = _OFFLOAD_INIT + '''
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.detach().to(m.device, torch.float32)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m.grad is not None:
                    p.copy_(m)
                    p.grad = None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
'''


def mistake(old: str, new: str) -> str:
    """The reference ``OFFLOADED`` with one mistake: ``old`` (there exactly once) replaced by ``new``."""
    assert OFFLOADED.count(old) == 1, old
    return OFFLOADED.replace(old, new)


OFFLOAD_MASTER_IN_MODEL_DTYPE = mistake(  # the "master" keeps the model's bf16: the small updates are lost
    "p.detach().to(offload_device, torch.float32, copy=True)", "p.detach().to(offload_device, copy=True)").replace(
    "p.grad.detach().to(m.device, torch.float32)", "p.grad.detach().to(m.device)")
OFFLOAD_ZERO_GRAD_FOR_MISSING = mistake(  # a parameter without a gradient gets a zero one: weight decay moves it
    "    def step(self):\n        self.optimizer.step()",
    "    def step(self):\n        for m in self.master:\n            if m.grad is None:\n"
    "                m.grad = torch.zeros_like(m)\n        self.optimizer.step()")
OFFLOAD_OVERWRITES_MICRO_BATCHES = mistake(  # each micro-batch replaces the last: accumulation loses all but one
    "        if m.grad is None:\n            m.grad = p.grad.detach().to(m.device, torch.float32)\n        else:\n"
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n",
    "        m.grad = p.grad.detach().to(m.device, torch.float32)\n")
OFFLOAD_KEEPS_MASTER_GRAD = mistake(  # step() leaves the masters' gradients: the next step adds to the last one's
    "                    p.copy_(m)\n                    m.grad = None\n", "                    p.copy_(m)\n")
OFFLOAD_ZERO_GRAD_KEEPS_MASTERS = mistake(  # zero_grad clears the model only: a discarded backward reaches the next step
    "            p.grad = None\n            m.grad = None\n", "            p.grad = None\n")
OFFLOAD_GRAD_LEFT_ON_MODEL = mistake(  # copied down, but never freed: the device still holds every gradient
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n        p.grad = None\n",
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n")
OFFLOAD_FREES_WHEN_BACKWARD_ENDS = mistake(  # freed once backward ends: none left after it, all held during it
    "        p.grad = None\n\n    def step",
    "        torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(p, 'grad', None))\n\n"
    "    def step")

CALLS_LIBRARY_OFFLOADED = '''
from course_lib.parallel.offload import OffloadedAdamW   # course_lib's
'''

FULL = {"test_OffloadedAdamW": 3, "test_OffloadedAdamW_hidden": 3}


def scores(**changed):
    return {**FULL, **changed}


CASES = {
    "offload_master_in_model_dtype": {"cells": {"OffloadedAdamW": OFFLOAD_MASTER_IN_MODEL_DTYPE},
                                      "scores": scores(test_OffloadedAdamW=0, test_OffloadedAdamW_hidden=0)},
    "offload_zero_grad_for_missing": {"cells": {"OffloadedAdamW": OFFLOAD_ZERO_GRAD_FOR_MISSING},  # right until a
                                      "scores": scores(test_OffloadedAdamW_hidden=0)},             # layer gets none
    "offload_at_step": {"cells": {"OffloadedAdamW": OFFLOAD_AT_STEP},
                        "scores": scores(test_OffloadedAdamW=0, test_OffloadedAdamW_hidden=0)},
    "offload_overwrites_micro_batches": {"cells": {"OffloadedAdamW": OFFLOAD_OVERWRITES_MICRO_BATCHES},
                                         "scores": scores(test_OffloadedAdamW_hidden=0)},
    "offload_keeps_master_grad": {"cells": {"OffloadedAdamW": OFFLOAD_KEEPS_MASTER_GRAD},  # zero_grad hides it
                                  "scores": scores(test_OffloadedAdamW_hidden=0)},              # in the visible test
    "offload_zero_grad_keeps_masters": {"cells": {"OffloadedAdamW": OFFLOAD_ZERO_GRAD_KEEPS_MASTERS},
                                        "scores": scores(test_OffloadedAdamW_hidden=0)},
    "offload_grad_left_on_model": {"cells": {"OffloadedAdamW": OFFLOAD_GRAD_LEFT_ON_MODEL},
                                   "scores": scores(test_OffloadedAdamW=0, test_OffloadedAdamW_hidden=0)},
    "offload_frees_when_backward_ends": {"cells": {"OffloadedAdamW": OFFLOAD_FREES_WHEN_BACKWARD_ENDS},
                                         "scores": scores(test_OffloadedAdamW=0, test_OffloadedAdamW_hidden=0)},
    "calls_library_OffloadedAdamW": {"cells": {"OffloadedAdamW": CALLS_LIBRARY_OFFLOADED},
                                     "scores": scores(test_OffloadedAdamW=0, test_OffloadedAdamW_hidden=0)},
}
