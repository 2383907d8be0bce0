"""Known submissions of 10_zero_offload and the scores nbgrader's autograde must give them.

Each case replaces the named solution cell of the solution notebook; every other solution cell keeps the reference
solution. ``scores`` gives the expected points of every graded cell. The mistakes are edits of today's solution cells
(tests/solved.py), never copies of them.
"""

from solved import edit, solution

# --- OffloadedAdamW (ZeRO-Offload's step by hand): the reference, and the mistakes students make

OFFLOADED = solution("10_zero_offload", "OffloadedAdamW")
SEND_DOWN = (
    "        if m.grad is None:  # the first micro-batch of this step: a fresh fp32 copy (non-blocking from a GPU)\n"
    "            m.grad = p.grad.detach().to(m.device, torch.float32, non_blocking=self.gpu)\n"
    "        else:               # a later one: add on p's device, behind the last copy down, and send the sum down\n"
    "            m.grad.copy_(m.grad.to(p.device, non_blocking=self.gpu) + p.grad, non_blocking=self.gpu)\n")
FREE = "        p.grad = None       # the gradient has left the device\n"
HOOKS = ("        for p, m in zip(self.params, self.master):\n"
         "            p.register_post_accumulate_grad_hook(lambda p, m=m: self._send_down(p, m))\n\n"
         "    def _send_down(self, p, m):\n"
         "        # no wait here: backward would stall behind every copy; step() waits for them all, once\n"
         + SEND_DOWN + FREE)
WAIT = ("        if self.gpu:\n"
        "            torch.cuda.synchronize()  # the copies down were queued without waiting: all land before AdamW reads them\n"
        "        self.optimizer.step()\n")
ZERO_GRAD = ("    def zero_grad(self, set_to_none=True):\n"
             "        for p, m in zip(self.params, self.master):\n"
             "            p.grad = None\n"
             "            m.grad = None")  # the cell's last line

# the contract before gradients left during backward: every gradient stays on the model until step() sends it down
OFFLOAD_AT_STEP = edit(
    OFFLOADED, (HOOKS, ""),
    (WAIT, "        for p, m in zip(self.params, self.master):\n"
           "            m.grad = None if p.grad is None else p.grad.detach().to(m.device, torch.float32)\n"
           "        self.optimizer.step()\n"),
    ("                    m.grad = None   # the next step starts from no gradient\n",
     "                    p.grad = None\n"),
    (ZERO_GRAD, "    def zero_grad(self, set_to_none=True):\n        for p in self.params:\n            p.grad = None"))

OFFLOAD_MASTER_IN_MODEL_DTYPE = edit(  # the "master" keeps the model's bf16: the small updates are lost
    OFFLOADED, ("p.detach().to(offload_device, torch.float32, copy=True)", "p.detach().to(offload_device, copy=True)"),
    ("p.grad.detach().to(m.device, torch.float32, non_blocking=self.gpu)",
     "p.grad.detach().to(m.device, non_blocking=self.gpu)"))
# a parameter without a gradient gets a zero one: weight decay moves it
OFFLOAD_ZERO_GRAD_FOR_MISSING = edit(OFFLOADED, (
    "        self.optimizer.step()\n",
    "        for m in self.master:\n            if m.grad is None:\n"
    "                m.grad = torch.zeros_like(m)\n        self.optimizer.step()\n"))
# each micro-batch replaces the last: accumulation loses all but one
OFFLOAD_OVERWRITES_MICRO_BATCHES = edit(OFFLOADED, (
    SEND_DOWN, "        m.grad = p.grad.detach().to(m.device, torch.float32, non_blocking=self.gpu)\n"))
# step() leaves the masters' gradients: the next step adds to the last one's
OFFLOAD_KEEPS_MASTER_GRAD = edit(OFFLOADED, (
    "                    m.grad = None   # the next step starts from no gradient\n", ""))
OFFLOAD_ZERO_GRAD_KEEPS_MASTERS = edit(  # zero_grad clears the model only: a discarded backward reaches the next step
    OFFLOADED, ("            p.grad = None\n            m.grad = None", "            p.grad = None"))
# copied down, but never freed: the device still holds every gradient
OFFLOAD_GRAD_LEFT_ON_MODEL = edit(OFFLOADED, (FREE, ""))
OFFLOAD_FREES_WHEN_BACKWARD_ENDS = edit(OFFLOADED, (  # freed once backward ends: none left after it, all held during it
    FREE, "        torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(p, 'grad', None))\n"))

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
