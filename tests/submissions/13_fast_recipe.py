"""Known submissions of 13_fast_recipe and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

# The reference chunked cross-entropy of the solution notebook; each mistake below changes it in one or two places.
CHUNKED = solution("13_fast_recipe", "chunked_cross_entropy")

# right numbers, the whole logits at once: what the exercise exists to avoid
WHOLE_LOGITS = '''
def chunked_cross_entropy(hidden, weight, targets, chunk=1024):
    return torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100)  # wrong: every logit
'''

# the mean over every token, the ignored ones counted in the denominator
MEAN_OVER_ALL_TOKENS = edit(CHUNKED, ("        n_valid = valid.sum().clamp(min=1)  # no target left: a loss of 0 and zero "
                                      "gradients, not nan",
                                      "        n_valid = torch.tensor(len(targets))  # wrong: the ignored tokens counted"))

# exp of the raw logits: right on small ones, inf on logits in the hundreds
NO_SHIFT = edit(CHUNKED, ("            lse = torch.logsumexp(logits, dim=-1)  # the max is subtracted inside: no overflow",
                          "            lse = logits.exp().sum(-1).log()  # wrong: exp overflows past 88"))

# backward returns the gradients of the loss, not of what was differentiated: a loss scaled before backward is wrong
GRAD_IGNORED = edit(CHUNKED, ("            g = probs * ((t != -100).float() * grad / ctx.n_valid)[:, None]  # ignored rows: no "
                              "gradient",
                              "            g = probs * ((t != -100).float() / ctx.n_valid)[:, None]  # wrong: grad ignored"))

# the loop stops a chunk early where the chunk does not divide the tokens (in forward and backward alike)
LAST_CHUNK_DROPPED = edit(CHUNKED, ("        for s in range(0, len(hidden), chunk):",
                                    "        for s in range(0, len(hidden) - chunk + 1, chunk):  # wrong: a short last chunk"),
                          ("        for s in range(0, len(hidden), ctx.chunk):",
                           "        for s in range(0, len(hidden) - ctx.chunk + 1, ctx.chunk):"))

# the ignored tokens' rows get the softmax's gradient too
IGNORED_ROWS_GET_GRADIENT = edit(CHUNKED, ("            g = probs * ((t != -100).float() * grad / ctx.n_valid)[:, None]  # "
                                           "ignored rows: no gradient",
                                           "            g = probs * (grad / ctx.n_valid)  # wrong: every row, ignored or not"))

CALLS_LIBRARY = '''
from course_lib.loss import _ChunkedLinearCrossEntropy


def chunked_cross_entropy(hidden, weight, targets, chunk=1024):
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, hidden.dtype, False)
'''

FULL = {"test_chunked_cross_entropy": 3, "test_chunked_cross_entropy_memory": 2, "test_chunked_cross_entropy_hidden": 4}
ALL = tuple(FULL)


def scores(*lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "whole_logits": {"cells": {"chunked_cross_entropy": WHOLE_LOGITS},
                     "scores": scores("test_chunked_cross_entropy_memory", "test_chunked_cross_entropy_hidden")},
    "mean_over_all_tokens": {"cells": {"chunked_cross_entropy": MEAN_OVER_ALL_TOKENS},
                             "scores": scores("test_chunked_cross_entropy", "test_chunked_cross_entropy_hidden")},
    "no_shift": {"cells": {"chunked_cross_entropy": NO_SHIFT}, "scores": scores("test_chunked_cross_entropy_hidden")},
    "grad_ignored": {"cells": {"chunked_cross_entropy": GRAD_IGNORED},
                     "scores": scores("test_chunked_cross_entropy_hidden")},
    "last_chunk_dropped": {"cells": {"chunked_cross_entropy": LAST_CHUNK_DROPPED},
                           "scores": scores("test_chunked_cross_entropy_hidden")},
    "ignored_rows_get_gradient": {"cells": {"chunked_cross_entropy": IGNORED_ROWS_GET_GRADIENT},
                                  "scores": scores("test_chunked_cross_entropy", "test_chunked_cross_entropy_hidden")},
    "calls_library_chunked_cross_entropy": {"cells": {"chunked_cross_entropy": CALLS_LIBRARY}, "scores": scores(*ALL)},
}
