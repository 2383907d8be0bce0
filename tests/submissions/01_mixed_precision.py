"""Known submissions of 01_mixed_precision and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

# --- the dynamic loss scaler: the reference solution with one mistake each

SCALER = solution("01_mixed_precision", "DynamicLossScaler")

SCALER_NEVER_GROWS = edit(SCALER, ("""            if self.clean_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0""", """            pass   # forgot to grow: the scale only ever falls, and fp16's small gradients underflow again"""))

SCALER_UNSCALES_TWICE = edit(SCALER, ("""        if self.found_inf is not None:
            return  # once per step: the gradients are in true units already
""", ""))   # train_step calls unscale_ before step: the gradients are divided twice

SCALER_MISSES_NAN = edit(SCALER, (
    "found = found or not bool(torch.isfinite(p.grad).all())",
    "found = found or bool(torch.isinf(p.grad).any())   # nan is not inf: a nan step is applied"))

SCALER_KEEPS_COUNTING_AFTER_OVERFLOW = edit(SCALER, ("""            self.scale_value *= self.backoff_factor
            self.clean_steps = 0""", """            self.scale_value *= self.backoff_factor   # the count of clean steps goes on across the overflow"""))

CALLS_LIBRARY_SCALER = '''
class DynamicLossScaler:   # the course's scaler (course_lib.precision.make_scaler), not the student's
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        from course_lib.precision import make_scaler
        self._scaler = make_scaler("cpu", "float16", init_scale)
        self._scaler.set_growth_factor(growth_factor)
        self._scaler.set_backoff_factor(backoff_factor)
        self._scaler.set_growth_interval(growth_interval)

    def __getattr__(self, name):
        return getattr(self._scaler, name)
'''

CALLS_TORCH_SCALER = '''
class DynamicLossScaler(torch.amp.GradScaler):   # torch's scaler, not the student's
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__("cpu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval)
'''

# --- the AMP training step

AMP_STEP = solution("01_mixed_precision", "amp_train_step")

AMP_FP16_WITHOUT_SCALER = edit(AMP_STEP, ("""    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
""", """    loss.backward()        # no scaler: small fp16 gradients underflow, overflowing steps are applied
    optimizer.step()
"""))

AMP_NO_AUTOCAST = edit(AMP_STEP, ("""    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
""", """    loss = F.cross_entropy(model(x), y)   # forgot autocast: everything runs in float32
"""))

AMP_NO_UPDATE = edit(AMP_STEP, ("""    scaler.step(optimizer)
    scaler.update()
""", """    scaler.step(optimizer)   # forgot scaler.update(): the scale never backs off after an overflow
"""))

CALLS_LIBRARY_AMP_STEP = '''
def amp_train_step(model, optimizer, scaler, x, y, amp_dtype):
    from course_lib.train import train_step
    return train_step(model, optimizer, (x, y), amp_dtype=amp_dtype, scaler=scaler)["loss"]   # the course's step
'''

FULL = {"test_DynamicLossScaler": 3, "test_DynamicLossScaler_hidden": 3, "test_amp_train_step": 2,
        "test_amp_train_step_hidden": 2}


def scores(**changed):
    return {**FULL, **changed}


NO_SCALER_POINTS = dict(test_DynamicLossScaler=0, test_DynamicLossScaler_hidden=0)
NO_AMP_POINTS = dict(test_amp_train_step=0, test_amp_train_step_hidden=0)
CASES = {
    "scaler_never_grows": {"cells": {"DynamicLossScaler": SCALER_NEVER_GROWS}, "scores": scores(**NO_SCALER_POINTS)},
    "scaler_unscales_twice": {  # right in seed 002's loop; train_step calls unscale_ before step
        "cells": {"DynamicLossScaler": SCALER_UNSCALES_TWICE}, "scores": scores(test_DynamicLossScaler_hidden=0)},
    "scaler_misses_nan": {"cells": {"DynamicLossScaler": SCALER_MISSES_NAN}, "scores": scores(**NO_SCALER_POINTS)},
    "scaler_keeps_counting_after_overflow": {"cells": {"DynamicLossScaler": SCALER_KEEPS_COUNTING_AFTER_OVERFLOW},
                                             "scores": scores(**NO_SCALER_POINTS)},
    "calls_library_DynamicLossScaler": {"cells": {"DynamicLossScaler": CALLS_LIBRARY_SCALER},
                                        "scores": scores(**NO_SCALER_POINTS)},
    "calls_torch_gradscaler": {"cells": {"DynamicLossScaler": CALLS_TORCH_SCALER},
                               "scores": scores(**NO_SCALER_POINTS)},
    "fp16_without_scaler": {  # unscaled fp16 gradients lose the small values (visible) and overflow is not skipped
        "cells": {"amp_train_step": AMP_FP16_WITHOUT_SCALER}, "scores": scores(**NO_AMP_POINTS)},
    "no_autocast": {  # the forward runs in float32, and in float32 the scaled gradients never overflow
        "cells": {"amp_train_step": AMP_NO_AUTOCAST}, "scores": scores(**NO_AMP_POINTS)},
    "no_scaler_update": {  # the step is skipped, but the scale stays at 2^40
        "cells": {"amp_train_step": AMP_NO_UPDATE}, "scores": scores(test_amp_train_step_hidden=0)},
    "calls_library_amp_train_step": {"cells": {"amp_train_step": CALLS_LIBRARY_AMP_STEP},
                                     "scores": scores(**NO_AMP_POINTS)},
}
