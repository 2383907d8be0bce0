"""Known submissions of 02_gradient_accumulation and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

ACCUMULATE_NOT_DIVIDED = '''
def accumulate_gradients(model, x, y, micro_batch):
    n = x.shape[0]
    if n % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} does not divide {n}")
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):
        loss = F.cross_entropy(model(xm), ym)   # forgot: / number of micro-batches
        loss.backward()
        total += loss.item()
    return total / (n // micro_batch)
'''

ACCUMULATE_KEEPS_STALE_GRADS = '''
def accumulate_gradients(model, x, y, micro_batch):
    n = x.shape[0]
    if n % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} does not divide {n}")
    k = n // micro_batch
    total = 0.0   # forgot: model.zero_grad() -- old gradients get added in
    for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):
        loss = F.cross_entropy(model(xm), ym) / k
        loss.backward()
        total += loss.item()
    return total
'''

NO_SYNC_ALWAYS = '''
def micro_step_context(model, micro_index, accum_steps):
    if hasattr(model, "no_sync"):
        return model.no_sync()   # also on the last micro-batch: gradients never all-reduced
    return contextlib.nullcontext()
'''

NO_SYNC_NEVER = '''
def micro_step_context(model, micro_index, accum_steps):
    return contextlib.nullcontext()   # all-reduces after every micro-batch
'''

CASES = {
    "loss_not_divided": {
        "cells": {"accumulate_gradients": ACCUMULATE_NOT_DIVIDED},
        "scores": {"test_accumulate_gradients": 0, "test_accumulate_gradients_hidden": 0,
                   "test_accumulate_gradients_errors": 1, "test_micro_step_context": 2,
                   "test_micro_step_context_hidden": 1},
    },
    "stale_gradients": {  # passes the visible test (fresh model), fails the hidden one
        "cells": {"accumulate_gradients": ACCUMULATE_KEEPS_STALE_GRADS},
        "scores": {"test_accumulate_gradients": 2, "test_accumulate_gradients_hidden": 0,
                   "test_accumulate_gradients_errors": 1, "test_micro_step_context": 2,
                   "test_micro_step_context_hidden": 1},
    },
    "no_sync_always": {
        "cells": {"micro_step_context": NO_SYNC_ALWAYS},
        "scores": {"test_accumulate_gradients": 2, "test_accumulate_gradients_hidden": 2,
                   "test_accumulate_gradients_errors": 1, "test_micro_step_context": 0,
                   "test_micro_step_context_hidden": 0},
    },
    "no_sync_never": {
        "cells": {"micro_step_context": NO_SYNC_NEVER},
        "scores": {"test_accumulate_gradients": 2, "test_accumulate_gradients_hidden": 2,
                   "test_accumulate_gradients_errors": 1, "test_micro_step_context": 0,
                   "test_micro_step_context_hidden": 1},
    },
}

# The submission that loops forever in this solution cell loses only its own tests.
LOOP_CELL = "accumulate_gradients"
