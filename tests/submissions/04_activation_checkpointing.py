"""Known submissions of 04_activation_checkpointing and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

NO_RECOMPUTATION = '''
def checkpointed(block, *inputs, **kwargs):
    return block(*inputs, **kwargs)   # right output and gradients, but autograd keeps everything inside
'''

CHECKPOINTED = '''
class _Recompute(torch.autograd.Function):
    """Keeps the block's inputs, not what happens inside it; runs the block again in backward."""

    @staticmethod
    def forward(ctx, run, n_inputs, *inputs_then_params):
        inputs = inputs_then_params[:n_inputs]
        ctx.run, ctx.n_inputs, ctx.params = run, n_inputs, inputs_then_params[n_inputs:]
        ctx.device_type = inputs[0].device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if inputs[0].is_cuda else None
        ctx.save_for_backward(*inputs)  # only the inputs: nothing the block computes is kept
        with torch.autocast(ctx.device_type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            return run(*inputs)  # inside a Function's forward, autograd records nothing

    @staticmethod
    def backward(ctx, grad_out):
        needs = ctx.needs_input_grad[2:2 + ctx.n_inputs]
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
        devices = [torch.cuda.current_device()] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):  # the same random numbers as the forward drew
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                out = ctx.run(*inputs)
        wanted = [x for x in inputs if x.requires_grad] + list(ctx.params)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if x.requires_grad else None for x in inputs], *grads)


def checkpointed(block, *inputs, **kwargs):
    params = [p for p in block.parameters() if p.requires_grad]
    # the parameters are inputs of the Function: its backward runs, and returns their gradients, even
    # when no input requires grad (the reentrant pitfall of section 4)
    return _Recompute.apply(lambda *xs: block(*xs, **kwargs), len(inputs), *inputs, *params)
'''


def mistake(base: str, old: str, new: str) -> str:
    """The reference solution ``base`` with one mistake: ``old`` replaced by ``new`` (which must be in it)."""
    assert old in base, old
    return base.replace(old, new)

PARAMETERS_NOT_INPUTS = mistake(mistake(CHECKPOINTED, """        wanted = [x for x in inputs if x.requires_grad] + list(ctx.params)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if x.requires_grad else None for x in inputs], *grads)""", """        # the parameters' gradients land in .grad by themselves, but only if this backward runs at all:
        # with no input requiring grad, autograd never calls it (the reentrant pitfall)
        torch.autograd.backward(out, grad_out)
        return (None, None, *[x.grad for x in inputs])"""),
    "len(inputs), *inputs, *params)", "len(inputs), *inputs)")

RNG_NOT_RESTORED = mistake(CHECKPOINTED, """        with torch.random.fork_rng(devices=devices):  # the same random numbers as the forward drew
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
""", """        if True:   # forgot the RNG: dropout draws a new mask in the recomputation
""")

RECOMPUTES_OUTSIDE_AUTOCAST = mistake(CHECKPOINTED, """            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):""",
                                      """            with torch.enable_grad():   # backward runs outside autocast: the recomputation is float32""")

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
