"""Known-wrong submissions that attack the grader instead of solving, for every assignment.

Three attacks, each stopped by the grading kernel's sandbox (course_grader.sandbox, started by nbgrader_config.py):

- ``copy_reference_<exercise>``: the solution cell copies course_lib's reference of the mechanism, by
  ``exec(inspect.getsource(...))`` or by exec'ing the reference's module file, so that ``forbid()`` (which
  watches the library's own objects) never sees it called. The grading kernel imports the student edition
  of course_lib, where every graded reference is a stub: the copy raises, and the exercise scores 0.
- ``read_solutions_<exercise>``: the solution cell looks for ``solutions/<assignment>/<assignment>.ipynb``
  in every folder above its working folder, and in the instructor's repository, and execs the solution
  cell it finds there. The sandbox denies every read: the cell fails, the exercise scores 0.
- ``write_gradebook`` (one assignment, GRADEBOOK_ASSIGNMENT): a known-wrong answer whose cell first opens
  ``../../../gradebook.db`` with sqlite3 and gives every grade of every student its maximum and extra
  credit. The sandbox denies the open: the wrong code scores what it deserves, and the gradebook of every
  other student is unchanged (tests/test_instructor_flow.py compares it before and after).

Each assignment gets one attack per exercise (a copy where course_lib holds a graded reference of it, the
gradebook write on GRADEBOOK_EXERCISE, else a read of solutions/), so that together they cost at most one more
autograded notebook per assignment (tests/nbgrading.py, ``bundle``).
``cases(assignment, tests_of)`` gives them in the format of tests/submissions/NN_*.py.
"""

from __future__ import annotations

from pathlib import Path

import nbgrading  # tests/nbgrading.py: the known submissions of every assignment

REPO = Path(__file__).resolve().parents[2]  # the instructor's repository (the course graded in tests is a copy)
GRADEBOOK_ASSIGNMENT = "00_orientation"  # the one notebook autograded whole (tests/test_instructor_flow.py)
GRADEBOOK_CASE = "gqa_ignored"

# A known-wrong answer of that assignment, its own GRADEBOOK_CASE (the parameter count ignores grouped-query
# attention): the attack writes the gradebook, then defines it, and must lose that case's tests only.
_GRADEBOOK_CASE = nbgrading.cases(GRADEBOOK_ASSIGNMENT).CASES[GRADEBOOK_CASE]
(GRADEBOOK_EXERCISE, BENEATH), = _GRADEBOOK_CASE["cells"].items()
BENEATH_LOSES = tuple(test for test, score in _GRADEBOOK_CASE["scores"].items() if score == 0)

WRITE_GRADEBOOK = '''
import sqlite3
try:   # the grader's gradebook, three folders above autograded/<student>/<assignment>/
    _db = sqlite3.connect("file:../../../gradebook.db?mode=rw", uri=True, timeout=10)
    _db.execute("UPDATE grade SET manual_score = (SELECT max_score FROM grade_cells WHERE grade_cells.id = grade.cell_id), "
                "extra_credit = 100")
    _db.commit()
    _db.close()
    print("wrote every grade of every student")
except Exception as _err:
    print(f"could not write the gradebook: {_err!r}")
''' + BENEATH


def _getsource(module: str, name: str, into: str) -> str:
    """A cell that copies course_lib.<module>.<name> by its source into the namespace ``into``, which starts as a copy
    of the module's globals (its helpers); each cell has its own, so a copy stays bound to what it copied."""
    return (f"import inspect\nimport course_lib.{module}\n{into} = dict(vars(course_lib.{module}))\n"
            f"exec(inspect.getsource(course_lib.{module}.{name}), {into})   # a copy: forbid() watches the library's object\n")


def _module_file(module: str, into: str) -> str:
    """A cell that execs course_lib/<module>.py's whole file into the namespace ``into``."""
    return (f"import course_lib.{module}\n{into} = {{'__name__': course_lib.{module}.__name__}}\n"
            f"with open(course_lib.{module}.__file__) as _f:\n    exec(_f.read(), {into})   # the reference and its helpers\n")


# exercise → the solution cell that copies its reference (the graded mechanisms course_lib marks), then adapts it
# the way the assignment's calls_library_<exercise> case adapts the library's own object.
COPIES = {
    ("02_fp8", "DelayedScalingFP8"): _getsource("fp8", "DelayedScaler", "_fp8")
    + "\nclass DelayedScalingFP8(_fp8['DelayedScaler']):\n    pass\n",
    ("05_input_pipeline", "Prefetcher"): _module_file("dataloader", "_dataloader")
    + "Prefetcher = _dataloader['Prefetcher']\n",
    ("06_ddp", "average_gradients"): _getsource("parallel.ddp", "all_reduce_gradients", "_all_reduce")
    + "\ndef average_gradients(model):\n    _all_reduce['all_reduce_gradients'](model)\n",
    # the whole file: a copy of the class alone still calls the library's bucket_parameters, which forbid() stops
    ("07_ddp_reducer", "BucketedDDP"): _module_file("parallel.ddp", "_bucketed")
    + "BucketedDDP = _bucketed['BucketedDDP']\n",
    ("08_fsdp", "ShardedModule"): _module_file("parallel.fsdp", "_fsdp")
    + "GatherParameter, ShardedModule = _fsdp['GatherParameter'], _fsdp['ShardedModule']\n",
    ("09_deepspeed_zero", "ShardedOptimizer"): _getsource("parallel.zero", "ShardedOptimizer", "_zero1")
    + "ShardedOptimizer = _zero1['ShardedOptimizer']\n",
    ("10_zero_offload", "OffloadedAdamW"): _module_file("parallel.offload", "_offload")
    + "OffloadedAdamW = _offload['OffloadedAdamW']\n",
    ("11_llama_finetune", "lora_params"): _module_file("lora", "_lora")
    + "\ndef lora_params(config, r, target_modules):\n    return _lora['lora_trainable_parameters'](config, r, target_modules)\n",
    ("12_qlora", "nf4_quantize"): _getsource("nf4", "quantize_nf4", "_nf4") + '''
def nf4_quantize(w, blocksize=64):
    packed, absmax = _nf4["quantize_nf4"](w, blocksize)
    return _nf4["unpack_4bit"](packed, w.numel()), absmax


def nf4_dequantize(codes, absmax, shape, blocksize=64):
    return _nf4["dequantize_nf4"](_nf4["pack_4bit"](codes), absmax, shape, blocksize)
''',
    ("14_tensor_parallelism", "tensor_parallel_pair"): _module_file("parallel.tp", "_tp_copy") + '''
CopyToTP, ReduceFromTP = None, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.inner = _tp_copy["ColumnParallelLinear"].from_linear(linear, dist.get_rank(), dist.get_world_size())
        self.weight, self.bias = self.inner.weight, self.inner.bias

    def forward(self, x):
        return self.inner(x)


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.inner = _tp_copy["RowParallelLinear"].from_linear(linear, dist.get_rank(), dist.get_world_size())
        self.weight, self.bias = self.inner.weight, self.inner.bias

    def forward(self, x):
        return self.inner(x)
''',
    ("15_pipeline_parallelism", "one_f_one_b_order"): _getsource("parallel.pp", "one_f_one_b_order", "_pp")
    + "one_f_one_b_order = _pp['one_f_one_b_order']\n",
    ("16_context_parallelism", "ring_attention"): _module_file("parallel.cp", "_cp")
    + '''merge = _cp["online_softmax_merge"]


def ring_forward(q, k, v, causal, seq_len):
    return _cp["ring_forward"](q, k, v, causal=causal, seq_len=seq_len, merge=merge)[:2]
''',
    ("17_expert_parallelism", "expert_parallel"): _module_file("parallel.ep", "_ep")
    + "within_capacity, dispatch, combine = _ep['within_capacity'], _ep['dispatch'], _ep['combine']\n",
}
# Every course_lib definition marked `# graded:` when this was written has its copy here; an exercise without an
# entry gets read_solutions_<exercise> instead. A reference marked later belongs here too.


def read_solutions(assignment: str, exercise: str) -> str:
    """A cell that finds solutions/<assignment>/<assignment>.ipynb above its folder or in the instructor's
    repository, and execs that notebook's solution cell ``exercise``."""
    return f'''
import json
from pathlib import Path

def _solution_code(assignment, grade_id):
    _name = Path("solutions") / assignment / f"{{assignment}}.ipynb"
    for _root in [Path.cwd(), *Path.cwd().parents, Path({str(REPO)!r})]:
        try:
            _nb = json.loads((_root / _name).read_text())
        except OSError as _err:   # missing here, or (in the sandbox) not readable
            print(f"{{_root / _name}}: {{_err!r}}")
            continue
        for _cell in _nb["cells"]:
            if _cell["metadata"].get("nbgrader", {{}}).get("grade_id") == grade_id:
                return "".join(_cell["source"])
    raise FileNotFoundError("no readable solutions/ notebook")

exec(_solution_code({assignment!r}, {exercise!r}))
'''


def cases(assignment: str, tests_of: dict[str, list[str]]) -> dict[str, dict]:
    """The attack cases of an assignment: ``{name: {"cells": {exercise: source}, "loses": [test cells]}}``.

    ``tests_of`` maps each exercise to its test cells; a case's ``loses`` are the test cells it must score 0
    on (the caller fills in full marks for the rest).
    """
    out = {}
    for exercise, tests in tests_of.items():
        if assignment == GRADEBOOK_ASSIGNMENT and exercise == GRADEBOOK_EXERCISE:
            out["write_gradebook"] = {"cells": {exercise: WRITE_GRADEBOOK}, "loses": list(BENEATH_LOSES)}
        elif (assignment, exercise) in COPIES:
            out[f"copy_reference_{exercise}"] = {"cells": {exercise: COPIES[assignment, exercise]}, "loses": tests}
        else:
            out[f"read_solutions_{exercise}"] = {"cells": {exercise: read_solutions(assignment, exercise)},
                                                 "loses": tests}
    return out


# ---------------------------------------------------------------- attacks on the tests themselves
# Where an assignment's test cells call check(...), the grader judges outside the kernel (course_grader.grade):
# these attacks, which beat tests that ran in the student's kernel, must score what the code beneath them deserves.
REBIND_FORBID = '''
import contextlib
import sys

import course_grader.grading

_off = lambda *answers, **kw: contextlib.nullcontext()   # forbid(...) that forbids nothing
course_grader.grading.forbid = forbid = _off
for _module in list(sys.modules.values()):   # and in every module that imported it, the tests' own included
    if getattr(_module, "__name__", "").startswith("course_lib") and hasattr(_module, "forbid"):
        _module.forbid = _off
'''

DISARM_FORBID = '''
import contextlib

import course_grader.grading

# forbid(...) as a generator context manager did nothing once contextlib's class was patched; forbid is a plain
# class of course_lib's, whose methods the grading process puts back before every probe
contextlib._GeneratorContextManager.__enter__ = lambda self: None
contextlib._GeneratorContextManager.__exit__ = lambda self, *exc: False
course_grader.grading.forbid.__enter__ = lambda self: self
course_grader.grading.forbid.__exit__ = lambda self, *exc: False
try:   # the code of the function that swaps an answer out: the audit hook refuses
    course_grader.grading._swap_in.__code__ = (lambda fn, message: None).__code__
except Exception as _err:
    print(f"refused: {_err}")
'''

# The student's definitions reach a GPU machine's ranks by value (cloudpickle), and unpickling runs what an object's
# __reduce__ names: here, forbid switched off in the rank before the check's worker enters it, so torch's DDP (which
# 07 forbids and the student edition cannot stub) would do the work. Notebook 07's BucketedDDP, the one multi-rank
# exercise whose spawned ranks tests/test_checks.py starts for real.
_TORCH_DDP = nbgrading.cases("07_ddp_reducer").CALLS_TORCH_DDP  # 07's known submission: torch's DDP does the work
_TORCH_DDP_CLASS = "class BucketedDDP(torch.nn.Module):   # torch's DDP does the work; nothing to finish\n"
assert _TORCH_DDP.count(_TORCH_DDP_CLASS) == 1
DISARM_IN_RANK = '''
class _Disarm:   # unpickled in each rank that receives BucketedDDP by value
    def __reduce__(self):
        return exec, ("import course_grader.grading as g\\n"
                      "g.forbid.__enter__ = lambda self: self\\n"
                      "g.forbid.__exit__ = lambda self, *exc: False\\n",)
''' + _TORCH_DDP.replace(_TORCH_DDP_CLASS, _TORCH_DDP_CLASS + "    _switch = _Disarm()\n\n")

SWALLOW_ERRORS = '''
import ast


class _Swallow(ast.NodeTransformer):   # every later cell runs inside try/except: no test can fail
    def visit_Module(self, node):
        handler = ast.ExceptHandler(type=None, name=None, body=[ast.Pass()])
        return ast.fix_missing_locations(ast.Module(body=[ast.Try(body=node.body, handlers=[handler], orelse=[],
                                                                  finalbody=[])], type_ignores=[]))


get_ipython().ast_transformers.append(_Swallow())
'''

# Patching what a test compares with: per assignment, a known-wrong case and the patch appended to its cell, which
# makes the test's reference agree with the wrong answer where the test runs in the kernel.
PATCH_HELPERS = {
    "00_orientation": ("one_adam_state", '''
import torch

import course_lib.memory

_measured = course_lib.memory.measure_training_step


def _agreeing(*args, **kwargs):   # the measurement the tests compare with, made to agree with the wrong answer
    out = dict(_measured(*args, **kwargs))
    out["optimizer states"] //= 2
    return out


course_lib.memory.measure_training_step = measure_training_step = _agreeing
torch.allclose = torch.equal = lambda *args, **kwargs: True
'''),
    "01_mixed_precision": ("scaler_never_grows", '''
import torch

_init = torch.amp.GradScaler.__init__


def _never_grows(self, *args, **kwargs):   # the reference scaler the tests compare with, made to agree with the wrong answer
    kwargs["growth_interval"] = 2**30
    _init(self, *args, **kwargs)


torch.amp.GradScaler.__init__ = _never_grows
'''),
    "02_fp8": ("fp8_no_clamp", '''
import course_lib.fp8


def _agreeing(x, scale, dtype):   # the cast the tests compare with, made to agree with the wrong answer: no clamp
    return (x.float() * scale).to(dtype)


course_lib.fp8.quantize = quantize = _agreeing
'''),
    "03_gradient_accumulation": ("loss_not_divided", '''
import course_grader.grading

course_grader.grading.max_rel_diff = max_rel_diff = lambda *args, **kwargs: 0.0   # every gradient comparison agrees
'''),
    "06_ddp": ("sum_not_divided", '''
import course_grader.grading

course_grader.grading.max_rel_diff = max_rel_diff = lambda *args, **kwargs: 0.0   # every gradient comparison agrees
'''),
    "07_ddp_reducer": ("bucketed_sum_not_averaged", '''
import course_grader.grading

course_grader.grading.max_rel_diff = max_rel_diff = lambda *args, **kwargs: 0.0   # every gradient comparison agrees
'''),
    "11_llama_finetune": ("lora_one_layer", '''
import course_lib.lora

_trainable = course_lib.lora.trainable_parameters


def _agreeing(model):   # the count the tests compare with, made to agree with the wrong answer: one layer's
    return _trainable(model) // model.config.num_hidden_layers


course_lib.lora.trainable_parameters = trainable_parameters = _agreeing
'''),
    "15_pipeline_parallelism": ("backward_too_soon", '''
import course_lib.parallel.pp
import course_lib.parallel.pp_cost


def _agreeing_makespan(order, t_f=1.0, t_b=2.0):   # the simulation the tests compare with: the formula's bubble
    return {"bubble": course_lib.parallel.pp_cost.bubble_formula(len(order), len(order[0]) // 2)}


def _agreeing_orders(timeline):   # "the order torch ran": the wrong order itself
    return one_f_one_b_order(len({e["rank"] for e in timeline}), len({e["mb"] for e in timeline}))


course_lib.parallel.pp_cost.schedule_makespan, course_lib.parallel.pp.rank_orders = _agreeing_makespan, _agreeing_orders
'''),
    "08_fsdp": ("grad_op_shards_weights", '''
import course_lib.parallel.fsdp_torch

_sweep = course_lib.parallel.fsdp_torch.sweep


def _agreeing(*args, **kwargs):   # the measured bytes the tests compare with: grad_op's full weights made a shard
    out = _sweep(*args, **kwargs)
    for run in out["runs"]:
        run["bytes"]["weights_in_backward"] = run["bytes"]["weights"]
    return out


course_lib.parallel.fsdp_torch.sweep = _agreeing
'''),
    "10_zero_offload": ("offload_master_in_model_dtype", '''
import course_grader.checks.nb10


def _agreeing(got, *args, **kwargs):   # the replay through torch's AdamW the tests compare with, made to pass anything
    return [m["value"] for m in got["masters"]]


course_grader.checks.nb10.judge_offload = _agreeing
'''),
    "12_qlora": ("qlora_bias_trains", '''
import course_grader.checks.nb12


def _agreeing(*args, **kwargs):   # peft's LoRA layer the tests compare with, made to pass anything
    return None


course_grader.checks.nb12.judge_qlora_layer = _agreeing
'''),
    "17_expert_parallelism": ("combine_wrong_order", '''
import course_grader.checks.nb17


def _agreeing(*args, **kwargs):   # the one-process layer the tests compare with, made to agree with anything
    return None


course_grader.checks.nb17.judge_ep = _agreeing
'''),
    "04_activation_checkpointing": ("no_recomputation", '''
import course_lib.memory

# the meter the tests read, made to see nothing kept (the block still runs, so its gradients are right)
course_lib.memory.activation_bytes = activation_bytes = lambda model, forward: (forward(), 0)[1]
'''),
}


# Pasting the source of an answer a check forbids but the student edition gives (it runs elsewhere in the notebook):
# the copy is a new function forbid cannot know, so it scores; the grading process flags it for the instructor
# (course_grader.audit: compiled source that holds most lines of a forbidden answer).
PASTE_GIVEN = {
    "00_orientation": ("training_memory", '''
import inspect

import course_lib.memory

_copies = dict(vars(course_lib.memory))   # its helpers, then copies of the two answers that call each other
exec(inspect.getsource(course_lib.memory.training_bytes_per_param), _copies)
exec(inspect.getsource(course_lib.memory.estimate_model_state), _copies)


def training_memory(n_params, mode):
    dtypes = {"fp32": "float32", "autocast": "float32", "pure_bf16": "bfloat16"}
    if mode not in dtypes:
        raise ValueError(f"mode={mode!r}: use one of {sorted(dtypes)}")
    return _copies["estimate_model_state"](n_params, dtypes[mode])
'''),
}
FLAGGED = ("paste_given_source", "disarm_forbid")  # the attacks the instructor's report must show


def _with(case: dict, extra: str) -> dict:
    """A known-wrong case with ``extra`` appended to its (one) replaced cell: the same expected scores."""
    (exercise, source), = case["cells"].items()
    return {"cells": {exercise: source + extra}, "scores": case["scores"]}


def on_the_tests(assignment: str) -> dict[str, dict]:
    """The attacks on the tests of ``assignment`` (where they are checks), each with the scores of the known-wrong
    case beneath it: ``rebind_forbid`` (the library's answer with forbid switched off), ``disarm_forbid`` (the
    library's answer with forbid's context manager patched to do nothing), ``paste_given_source`` where
    PASTE_GIVEN has one (full marks, flagged), ``swallow_errors`` (a wrong
    answer, every later cell wrapped in try/except) and, where PATCH_HELPERS has one, ``patch_helpers``."""
    solution = nbgrading.load_solution(assignment)
    checked = nbgrading.checked_ids(solution)  # an exercise whose tests are still inline keeps the kernel's weakness
    exercises = [ex for ex in nbgrading.solution_cells(solution) if set(nbgrading.tests_of(solution, ex)) <= checked]
    if not exercises:
        return {}
    known, last = nbgrading.cases(assignment).CASES, exercises[-1]
    wrong = next(c for n, c in known.items() if not n.startswith("calls_library") and list(c["cells"]) == [last])
    out = {"rebind_forbid": _with(known[f"calls_library_{exercises[0]}"], REBIND_FORBID),
           "disarm_forbid": _with(known[f"calls_library_{exercises[-1]}"], DISARM_FORBID),
           "swallow_errors": _with(wrong, SWALLOW_ERRORS)}
    if assignment in PATCH_HELPERS:
        name, patch = PATCH_HELPERS[assignment]
        out["patch_helpers"] = _with(known[name], patch)
    if assignment in PASTE_GIVEN:
        exercise, source = PASTE_GIVEN[assignment]
        out["paste_given_source"] = {"cells": {exercise: source}, "scores": nbgrading.grade_cells(solution)}
    return out
