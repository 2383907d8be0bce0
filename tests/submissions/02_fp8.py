"""Known submissions of 02_fp8 and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

# --- delayed-scaling FP8 quantisation: the reference solution with one mistake each

FP8_SCALER = solution("02_fp8", "DelayedScalingFP8")


FULL = {"test_DelayedScalingFP8": 3, "test_DelayedScalingFP8_hidden": 3}


def scores(**changed):
    return {**FULL, **changed}


FP8_CURRENT_SCALING = edit(FP8_SCALER, (
    "        used = self.scale  # from earlier calls only: no pass over x before it is quantised\n",
    """        amax = x.abs().max().item()   # just-in-time: the step's own amax sets its own scale
        if 0 < amax < math.inf:
            self.scale = self.fp8_max / amax / 2**self.margin
        used = self.scale
"""))

FP8_NO_CLAMP = edit(FP8_SCALER, (
    "q = (x.float() * used).clamp(-self.fp8_max, self.fp8_max).to(self.dtype)  # saturate: never inf or nan",
    "q = (x.float() * used).to(self.dtype)   # no clamp: past max e5m2 gives inf (e4m3fn nan on older torch)"))

CALLS_LIBRARY_FP8 = '''
from course_lib.fp8 import DelayedScaler

class DelayedScalingFP8(DelayedScaler):   # the course's delayed scaler, not the student's
    pass
'''

NO_FP8_POINTS = dict(test_DelayedScalingFP8=0, test_DelayedScalingFP8_hidden=0)
CASES = {
    "fp8_current_scaling": {  # the visible test's scales are the previous steps'; the hidden ones hold for any scale
        "cells": {"DelayedScalingFP8": FP8_CURRENT_SCALING}, "scores": scores(test_DelayedScalingFP8=0)},
    "fp8_no_clamp": {  # no overflow in the visible test; the hidden amax jump overflows e5m2 to inf
        "cells": {"DelayedScalingFP8": FP8_NO_CLAMP}, "scores": scores(test_DelayedScalingFP8_hidden=0)},
    "calls_library_DelayedScalingFP8": {"cells": {"DelayedScalingFP8": CALLS_LIBRARY_FP8},
                                        "scores": scores(**NO_FP8_POINTS)},
}
