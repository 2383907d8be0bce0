"""Known submissions of 04_activation_checkpointing and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

NO_RECOMPUTATION = '''
def checkpointed(block, *inputs, **kwargs):
    return block(*inputs, **kwargs)   # right output and gradients, but autograd keeps everything inside
'''

CHECKPOINTED = solution("04_activation_checkpointing", "checkpointed")

PARAMETERS_NOT_INPUTS = edit(CHECKPOINTED, ("""        wanted = [x for x in inputs if x.requires_grad] + list(ctx.params)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if x.requires_grad else None for x in inputs], *grads)""", """        # the parameters' gradients land in .grad by themselves, but only if this backward runs at all:
        # with no input requiring grad, autograd never calls it (the reentrant pitfall)
        torch.autograd.backward(out, grad_out)
        return (None, None, *[x.grad for x in inputs])"""),
    ("len(inputs), *inputs, *params)", "len(inputs), *inputs)"))

RNG_NOT_RESTORED = edit(CHECKPOINTED, ("""        with torch.random.fork_rng(devices=devices):  # the same random numbers as the forward drew
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
""", """        if True:   # forgot the RNG: dropout draws a new mask in the recomputation
"""))

RECOMPUTES_OUTSIDE_AUTOCAST = edit(CHECKPOINTED, (
    "            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=ctx.autocast[1], "
    "enabled=ctx.autocast[0]):",
    "            with torch.enable_grad():   # backward runs outside autocast: the recomputation is float32"))

CALLS_LIBRARY = '''
def checkpointed(block, *inputs, **kwargs):
    from course_lib.checkpointing import CheckpointedBlock
    return CheckpointedBlock(block)(*inputs, **kwargs)   # course_lib's wrapper, not the student's
'''

CALLS_TORCH = '''
def checkpointed(block, *inputs, **kwargs):
    return torch.utils.checkpoint.checkpoint(block, *inputs, use_reentrant=False, **kwargs)   # torch's, not the student's
'''

FULL = {"test_checkpointed": 2, "test_checkpointed_inputs_hidden": 2, "test_checkpointed_rng_autocast_hidden": 2}


def scores(**changed):
    return {**FULL, **changed}


CASES = {
    "no_recomputation": {  # the gradients are right; what autograd keeps is not
        "cells": {"checkpointed": NO_RECOMPUTATION},
        "scores": scores(test_checkpointed=0, test_checkpointed_inputs_hidden=0,
                         test_checkpointed_rng_autocast_hidden=0)},
    "parameters_not_inputs_of_the_function": {  # right while an input requires grad; a frozen input loses them
        "cells": {"checkpointed": PARAMETERS_NOT_INPUTS}, "scores": scores(test_checkpointed_inputs_hidden=0)},
    "rng_not_restored": {"cells": {"checkpointed": RNG_NOT_RESTORED},
                         "scores": scores(test_checkpointed_rng_autocast_hidden=0)},
    "recomputes_outside_autocast": {"cells": {"checkpointed": RECOMPUTES_OUTSIDE_AUTOCAST},
                                    "scores": scores(test_checkpointed_rng_autocast_hidden=0)},
    "calls_library_checkpointed": {
        "cells": {"checkpointed": CALLS_LIBRARY},
        "scores": scores(test_checkpointed=0, test_checkpointed_inputs_hidden=0,
                         test_checkpointed_rng_autocast_hidden=0)},
    "calls_torch_checkpoint": {
        "cells": {"checkpointed": CALLS_TORCH},
        "scores": scores(test_checkpointed=0, test_checkpointed_inputs_hidden=0,
                         test_checkpointed_rng_autocast_hidden=0)},
}
