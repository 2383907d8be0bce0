"""Known submissions of 15_pipeline_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

GPIPE_ORDER = '''
def one_f_one_b_order(p, m):
    # wrong: GPipe's order, every forward then every backward: m micro-batches in flight
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
'''

# The reference 1F1B order of the solution notebook; each mistake below changes its warm-up.
ORDER_SOLUTION = solution("15_pipeline_parallelism", "one_f_one_b_order")
WARMUP = "        warmup = min(m, p - r)  # the forwards a rank runs before the first backward reaches it"

BACKWARD_TOO_SOON = edit(ORDER_SOLUTION, (WARMUP, "        warmup = min(m, p - r - 1)  # wrong: one forward too few, so the last rank "
                                     "starts with a backward"))

SAME_WARMUP_EVERY_RANK = edit(ORDER_SOLUTION, (WARMUP, "        warmup = min(m, p)  # wrong: rank 0's warm-up on every rank keeps later "
                                          "ranks too full"))

WARMUP_PAST_M = edit(ORDER_SOLUTION, (WARMUP, "        warmup = p - r  # wrong when m < p - r: forwards of micro-batches that do not exist"),
                                     ('''        order += [("B", i) for i in range(m - warmup, m)]  # drain''',
                                      '''        order += [("B", i) for i in range(max(m - warmup, 0), m)]'''))

CALLS_LIBRARY_ORDER = '''
def one_f_one_b_order(p, m):
    from course_lib.parallel.pp import one_f_one_b_order as order
    return order(p, m)
'''

# The reference 1F1B executor of the solution notebook; each mistake below changes it in one or two places.
EXECUTOR_SOLUTION = solution("15_pipeline_parallelism", "run_1f1b")

# dist.send waits for the peer's receive: rank 0 sends micro-batch 1's activation while rank 1 sends micro-batch 0's
# gradient, and neither receives: every run stops at the checks' 10 s timeout
BLOCKING_SENDS = edit(EXECUTOR_SOLUTION, ("""            else:  # not waited here: rank + 1 may be sending us a gradient right now, waiting for our receive
                send = dist.isend(out.detach(), rank + 1)""", """            else:
                dist.send(out.detach(), rank + 1)  # wrong: blocks until rank + 1 receives"""),
                                         ("""                send.wait()  # done already: rank + 1 ran B i, so it had received F i's output
""", ""), ("""                sends.append(dist.isend(x.grad, rank - 1))""",
                                          """                dist.send(x.grad, rank - 1)  # wrong: blocks until rank - 1 receives"""))

# right gradients, right count, but every micro-batch's input and output stay referenced until the step ends
KEEPS_EVERY_MICRO_BATCH = edit(EXECUTOR_SOLUTION, ("""            x, out, send = held.pop(i)  # the last references to micro-batch i: backward frees its graph""",
                                                   """            x, out, send = held[i]  # wrong: kept till the step ends, all m micro-batches' tensors"""),
                                                  ("""            del x, out  # micro-batch i's tensors go now, not when the next forward rebinds the names
""", ""))

NO_MEAN = edit(EXECUTOR_SOLUTION, ("""                (out / m).backward()  # the mean over micro-batches: every gradient upstream carries the 1/m""",
                                   """                out.backward()  # wrong: the sum of the m losses' gradients, m times the mean's"""))

# every forward, then every backward, whatever the order says: GPipe, m micro-batches held (and counted); the
# grader's rank 0 follows the order, and waits for micro-batch 0's gradient while rank 1 waits for micro-batch 3
IGNORES_THE_ORDER = edit(EXECUTOR_SOLUTION, ("""    for kind, i in order:""",
                                             """    for kind, i in sorted(order, key=lambda a: a[0] == "B"):  # wrong: all forwards first"""))

# nothing on the wire: every rank rebuilds the visible tests' stages (seed 0, one Linear per stage, drawn as the
# checks draw them), runs the whole pipeline in one process and keeps its own stage's gradients, and counts its
# order's peak. The ranks' data was one process's, so the visible tests that read it passed; the grader's rank 0,
# whose stage is drawn at grading, waits for a receive that never comes. (The hidden seeds were never known.)
EXECUTOR_LOCAL_COPY = '''
import torch
from torch import nn


def run_1f1b(stage, rank, p, micro_batches, order, loss_fn, shape):
    torch.manual_seed(0)
    linears = [nn.Linear(shape[1], shape[1]) for _ in range(p)]
    losses, m = [], len(micro_batches)
    for x, y in micro_batches:
        h = x
        for linear in linears:
            h = torch.tanh(linear(h))
        loss = loss_fn(h, y)
        (loss / m).backward()
        losses.append(loss.item())
    stage.linear.weight.grad, stage.linear.bias.grad = linears[rank].weight.grad, linears[rank].bias.grad
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return (losses if rank == p - 1 else []), peak
'''

CALLS_LIBRARY_EXECUTOR = '''
def run_1f1b(stage, rank, p, micro_batches, order, loss_fn, shape):
    from course_lib.parallel.pp import run_1f1b as run
    return run(stage, rank, p, micro_batches, order, loss_fn, shape)
'''

FULL = {"test_one_f_one_b_order": 3, "test_one_f_one_b_order_measured": 3, "test_one_f_one_b_order_hidden": 4, "test_run_1f1b": 3, "test_run_1f1b_activations": 3, "test_run_1f1b_hidden": 4}
ORDER = ("test_one_f_one_b_order", "test_one_f_one_b_order_measured", "test_one_f_one_b_order_hidden")
EXECUTOR = ("test_run_1f1b", "test_run_1f1b_activations", "test_run_1f1b_hidden")


def scores(*lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "gpipe_order": {"cells": {"one_f_one_b_order": GPIPE_ORDER}, "scores": scores(*ORDER)},
    "backward_too_soon": {"cells": {"one_f_one_b_order": BACKWARD_TOO_SOON}, "scores": scores(*ORDER)},
    "same_warmup_every_rank": {"cells": {"one_f_one_b_order": SAME_WARMUP_EVERY_RANK}, "scores": scores(*ORDER)},
    "warmup_past_m": {"cells": {"one_f_one_b_order": WARMUP_PAST_M}, "scores": scores("test_one_f_one_b_order_hidden")},
    "calls_library_one_f_one_b_order": {"cells": {"one_f_one_b_order": CALLS_LIBRARY_ORDER}, "scores": scores(*ORDER)},
    "blocking_sends": {"cells": {"run_1f1b": BLOCKING_SENDS}, "scores": scores(*EXECUTOR)},  # a deadlock: timeouts
    "keeps_every_micro_batch": {"cells": {"run_1f1b": KEEPS_EVERY_MICRO_BATCH},
                                "scores": scores("test_run_1f1b_activations", "test_run_1f1b_hidden")},
    "no_mean_over_micro_batches": {"cells": {"run_1f1b": NO_MEAN},
                                   "scores": scores("test_run_1f1b", "test_run_1f1b_hidden")},
    "ignores_the_order": {"cells": {"run_1f1b": IGNORES_THE_ORDER}, "scores": scores(*EXECUTOR)},
    "executor_local_copy": {"cells": {"run_1f1b": EXECUTOR_LOCAL_COPY}, "scores": scores(*EXECUTOR)},
    "calls_library_run_1f1b": {"cells": {"run_1f1b": CALLS_LIBRARY_EXECUTOR}, "scores": scores(*EXECUTOR)},
}
