"""Known submissions of 03_gradient_accumulation and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

ACCUMULATE = solution("03_gradient_accumulation", "accumulate_gradients")

ACCUMULATE_NOT_DIVIDED = edit(ACCUMULATE, (
    "        loss = F.cross_entropy(model(xm), ym) / k\n",
    "        loss = F.cross_entropy(model(xm), ym)   # forgot: / number of micro-batches\n"), (
    "    return total", "    return total / k"))

ACCUMULATE_KEEPS_STALE_GRADS = edit(ACCUMULATE, (
    "    model.zero_grad(set_to_none=True)\n    total = 0.0\n",
    "    total = 0.0   # forgot: model.zero_grad() -- old gradients get added in\n"))

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

CALLS_LIBRARY_ACCUMULATE = '''
def accumulate_gradients(model, x, y, micro_batch):
    from course_lib.train import split_batch
    k = x.shape[0] // micro_batch
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xm, ym in split_batch((x, y), k):   # the course's splitter
        loss = F.cross_entropy(model(xm), ym) / k
        loss.backward()
        total += loss.item()
    return total
'''

TOKENS = solution("03_gradient_accumulation", "accumulate_tokens")

TOKENS_MEAN_OF_MEANS = edit(TOKENS, ("""        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), part_labels[:, 1:].flatten(),
                                 ignore_index=-100, reduction="sum")
        (summed / n_scored).backward()
        total += summed.item() / n_scored""", """        mean = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), part_labels[:, 1:].flatten(), ignore_index=-100)
        (mean / (rows // micro_batch)).backward()   # each micro-batch's mean, weighted 1/k whatever it scores
        total += mean.item() / (rows // micro_batch)"""))

TOKENS_COUNTS_THE_FIRST_LABEL = edit(TOKENS, (
    "n_scored = int((labels[:, 1:] != -100).sum())  # N, counted before the first backward",
    "n_scored = int((labels != -100).sum())   # the first label of a row is never a target"))

TOKENS_NAN_ON_AN_EMPTY_MICRO_BATCH = edit(TOKENS, ("""        if not (part_labels[:, 1:] != -100).any():
            continue  # nothing to score: no forward, no nan
        logits = model(input_ids=part_ids).logits
        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), part_labels[:, 1:].flatten(),
                                 ignore_index=-100, reduction="sum")""", """        logits = model(input_ids=part_ids).logits
        n_part = int((part_labels[:, 1:] != -100).sum())
        mean = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), part_labels[:, 1:].flatten(), ignore_index=-100)
        summed = mean * n_part   # a micro-batch that scores nothing: 0/0 = nan, and nan * 0 is still nan"""))

TOKENS_KEEP_STALE_GRADIENTS = edit(TOKENS, ("    model.zero_grad(set_to_none=True)\n",
                                           "    # forgot: model.zero_grad(), so old gradients are added in\n"))

CALLS_LIBRARY_TOKENS = '''
def accumulate_tokens(model, batch, micro_batch):
    from course_lib.train import train_step
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return train_step(model, opt, batch, accum_steps=batch["input_ids"].shape[0] // micro_batch,
                      token_weighted=True)["loss"]   # the course's step (which then clears the gradients)
'''

SYNC_ON_THE_FIRST = edit(solution("03_gradient_accumulation", "micro_step_context"), (
    "    last = micro_index == accum_steps - 1\n    if last or not hasattr(model, \"no_sync\"):",
    "    if micro_index == 0 or not hasattr(model, \"no_sync\"):   # syncs the first micro-batch's partial sum"))

CALLS_LIBRARY_SYNC = '''
def micro_step_context(model, micro_index, accum_steps):
    from course_lib.train import grad_sync_context
    return grad_sync_context(model, last=micro_index == accum_steps - 1)   # the course's rule
'''

FULL = {"test_accumulate_gradients": 2, "test_accumulate_gradients_hidden": 2, "test_accumulate_gradients_errors": 1,
        "test_accumulate_tokens": 3, "test_accumulate_tokens_hidden": 3, "test_micro_step_context": 2,
        "test_micro_step_context_hidden": 1}


def scores(**changed):
    return {**FULL, **changed}


NO_TOKEN_POINTS = dict(test_accumulate_tokens=0, test_accumulate_tokens_hidden=0)
NO_SYNC_POINTS = dict(test_micro_step_context=0, test_micro_step_context_hidden=0)
CASES = {
    "loss_not_divided": {"cells": {"accumulate_gradients": ACCUMULATE_NOT_DIVIDED},
                         "scores": scores(test_accumulate_gradients=0, test_accumulate_gradients_hidden=0)},
    "stale_gradients": {  # passes the visible test (fresh model), fails the hidden one
        "cells": {"accumulate_gradients": ACCUMULATE_KEEPS_STALE_GRADS},
        "scores": scores(test_accumulate_gradients_hidden=0)},
    "calls_library_accumulate_gradients": {
        "cells": {"accumulate_gradients": CALLS_LIBRARY_ACCUMULATE},
        "scores": scores(test_accumulate_gradients=0, test_accumulate_gradients_hidden=0,
                         test_accumulate_gradients_errors=0)},
    "tokens_mean_of_means": {"cells": {"accumulate_tokens": TOKENS_MEAN_OF_MEANS}, "scores": scores(**NO_TOKEN_POINTS)},
    "tokens_count_the_first_label": {"cells": {"accumulate_tokens": TOKENS_COUNTS_THE_FIRST_LABEL},
                                     "scores": scores(**NO_TOKEN_POINTS)},
    "tokens_nan_on_an_empty_micro_batch": {  # the visible batch has no empty micro-batch
        "cells": {"accumulate_tokens": TOKENS_NAN_ON_AN_EMPTY_MICRO_BATCH},
        "scores": scores(test_accumulate_tokens_hidden=0)},
    "tokens_keep_stale_gradients": {"cells": {"accumulate_tokens": TOKENS_KEEP_STALE_GRADIENTS},
                                    "scores": scores(test_accumulate_tokens_hidden=0)},
    "calls_library_accumulate_tokens": {"cells": {"accumulate_tokens": CALLS_LIBRARY_TOKENS},
                                        "scores": scores(**NO_TOKEN_POINTS)},
    "no_sync_always": {"cells": {"micro_step_context": NO_SYNC_ALWAYS}, "scores": scores(**NO_SYNC_POINTS)},
    "no_sync_never": {"cells": {"micro_step_context": NO_SYNC_NEVER}, "scores": scores(**NO_SYNC_POINTS)},
    "sync_on_the_first_micro_batch": {  # one round of all-reduces in all: only which micro-batch sent it is wrong
        "cells": {"micro_step_context": SYNC_ON_THE_FIRST}, "scores": scores(**NO_SYNC_POINTS)},
    "calls_library_micro_step_context": {"cells": {"micro_step_context": CALLS_LIBRARY_SYNC},
                                         "scores": scores(**NO_SYNC_POINTS)},
}
