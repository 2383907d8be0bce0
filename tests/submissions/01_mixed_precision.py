"""Known submissions of 01_mixed_precision and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

UNSCALE_MULTIPLIES = '''
def unscale_and_check(params, scale):
    found_inf = False
    for p in params:
        if p.grad is None:
            continue
        p.grad.mul_(scale)   # wrong way round: scales the gradients up again
        if not torch.isfinite(p.grad).all():
            found_inf = True
    return found_inf
'''

UNSCALE_INF_ONLY = '''
def unscale_and_check(params, scale):
    found_inf = False
    for p in params:
        if p.grad is None:
            continue
        p.grad.div_(scale)
        if torch.isinf(p.grad).any():   # misses nan
            found_inf = True
    return found_inf
'''

AMP_FP16_WITHOUT_SCALER = '''
def amp_train_step(model, optimizer, scaler, x, y, amp_dtype):
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()        # no scaler: small fp16 gradients underflow, overflowing steps are applied
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
'''

AMP_NO_AUTOCAST = '''
def amp_train_step(model, optimizer, scaler, x, y, amp_dtype):
    loss = F.cross_entropy(model(x), y)   # forgot autocast: everything runs in float32
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
'''

AMP_NO_UPDATE = '''
def amp_train_step(model, optimizer, scaler, x, y, amp_dtype):
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=amp_dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)   # forgot scaler.update(): the scale never backs off after an overflow
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
'''

_FULL_AMP = {"test_amp_train_step": 2, "test_amp_train_step_hidden": 2}
_FULL_UNSCALE = {"test_unscale_and_check": 2, "test_unscale_and_check_hidden": 2}

CASES = {
    "unscale_multiplies": {
        "cells": {"unscale_and_check": UNSCALE_MULTIPLIES},
        "scores": {"test_unscale_and_check": 0, "test_unscale_and_check_hidden": 0, **_FULL_AMP},
    },
    "unscale_misses_nan": {  # passes the visible test (inf only), fails the hidden nan case
        "cells": {"unscale_and_check": UNSCALE_INF_ONLY},
        "scores": {"test_unscale_and_check": 2, "test_unscale_and_check_hidden": 0, **_FULL_AMP},
    },
    "fp16_without_scaler": {  # unscaled fp16 gradients lose the small values (visible) and overflow is not skipped
        "cells": {"amp_train_step": AMP_FP16_WITHOUT_SCALER},
        "scores": {**_FULL_UNSCALE, "test_amp_train_step": 0, "test_amp_train_step_hidden": 0},
    },
    "no_autocast": {  # the forward runs in float32, and in float32 the scaled gradients never overflow
        "cells": {"amp_train_step": AMP_NO_AUTOCAST},
        "scores": {**_FULL_UNSCALE, "test_amp_train_step": 0, "test_amp_train_step_hidden": 0},
    },
    "no_scaler_update": {  # the step is skipped, but the scale stays at 2^40
        "cells": {"amp_train_step": AMP_NO_UPDATE},
        "scores": {**_FULL_UNSCALE, "test_amp_train_step": 2, "test_amp_train_step_hidden": 0},
    },
}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "amp_train_step"
