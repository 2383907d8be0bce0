"""Known submissions of 03_activation_checkpointing and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

WRAPPER_WITHOUT_CHECKPOINT = '''
class Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)   # forgot the checkpoint: every activation is kept


def checkpoint_every(layers, k):
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    for i in range(0, len(layers), k):
        layers[i] = Checkpointed(layers[i])
    return layers
'''

REENTRANT = '''
class Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        # the old implementation: no keyword arguments, so bind them; no gradients when no input requires grad
        return checkpoint(functools.partial(self.block, **kwargs), *args, use_reentrant=True)


def checkpoint_every(layers, k):
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    for i in range(0, len(layers), k):
        layers[i] = Checkpointed(layers[i])
    return layers
'''

IGNORES_K = '''
class Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_every(layers, k):
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    for i in range(len(layers)):   # wraps every block, whatever k says
        layers[i] = Checkpointed(layers[i])
    return layers
'''

CHOOSE_SMALLEST = '''
def choose_policy(measurements, budget_bytes):
    fitting = [m for m in measurements if m[1] <= budget_bytes]
    if not fitting:
        raise ValueError(f"nothing fits in budget_bytes={budget_bytes}")
    return min(fitting, key=lambda m: m[1])[0]   # the least memory, not the fastest
'''

CHOOSE_RETURNS_NONE = '''
def choose_policy(measurements, budget_bytes):
    fitting = [m for m in measurements if m[1] <= budget_bytes]
    if not fitting:
        return None   # should raise ValueError
    return min(fitting, key=lambda m: (m[2], m[1]))[0]
'''

CASES = {
    "wrapper_without_checkpoint": {  # same gradients, but no memory saved
        "cells": {"checkpoint_every": WRAPPER_WITHOUT_CHECKPOINT},
        "scores": {"test_checkpoint_every": 0, "test_checkpoint_every_hidden": 0,
                   "test_choose_policy": 2, "test_choose_policy_hidden": 2},
    },
    "reentrant": {  # passes on a Llama whose embedding trains, fails when the input does not require grad
        "cells": {"checkpoint_every": REENTRANT},
        "scores": {"test_checkpoint_every": 2, "test_checkpoint_every_hidden": 0,
                   "test_choose_policy": 2, "test_choose_policy_hidden": 2},
    },
    "ignores_k": {  # right for k=1, wrong blocks for k=2 and k=3
        "cells": {"checkpoint_every": IGNORES_K},
        "scores": {"test_checkpoint_every": 2, "test_checkpoint_every_hidden": 0,
                   "test_choose_policy": 2, "test_choose_policy_hidden": 2},
    },
    "choose_smallest": {
        "cells": {"choose_policy": CHOOSE_SMALLEST},
        "scores": {"test_checkpoint_every": 2, "test_checkpoint_every_hidden": 2,
                   "test_choose_policy": 0, "test_choose_policy_hidden": 0},
    },
    "choose_returns_none": {  # right whenever something fits, no error when nothing does
        "cells": {"choose_policy": CHOOSE_RETURNS_NONE},
        "scores": {"test_checkpoint_every": 2, "test_checkpoint_every_hidden": 2,
                   "test_choose_policy": 2, "test_choose_policy_hidden": 0},
    },
}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "choose_policy"
