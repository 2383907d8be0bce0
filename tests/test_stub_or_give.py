"""The student's side of every exercise: what a reference solution calls in course_lib is stubbed or given.

A student reads the student edition's course_lib (docs/grading.md, "Two editions"). So every course_lib function or
class that a reference solution calls is one of:
- a graded reference (``# graded:`` marker: the student edition holds a stub that raises NotImplementedError),
- named in its exercise's text (the markdown and the given read-only cells between the previous exercise's solution
  cell and this one: the notebook hands it to the student), or
- on ``GIVEN`` below, with the reason a student may read it.
"A reference solution" is both a solution cell of solutions/*/*.ipynb (the course_lib names it calls, imported in
the notebook's earlier cells or in the cell itself) and course_lib's own reference of an exercise (a marked
definition: what it calls in course_lib). The calls are found by parsing (ast) and their names resolved by importing
course_lib's modules: no notebook code runs.

Two consequences are held too: no cell a student runs outside the solution cells (a demonstration, a given cell)
calls a graded reference, which is a stub in the student's kernel; and no visible check module (the student
edition holds them) has an expected answer in its messages: a solution line that its exercise's text does not give.

And answers are absent, not forbidden, while student code runs: every course_lib function or class that a check
passes to ``forbid`` (course_grader/checks/*.py, found by parsing and evaluated in the check module's namespace) is a
stub in the student edition that the grading process runs (``for_grading()``), or on ``GIVEN_FORBIDDEN`` with the
cell, module or check that needs it working. A forbidden object that is present can be copied: ``exec`` of its
source makes a new function that ``forbid`` does not know.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from course_grader.edition import graded_references

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "solutions").glob("*/*.ipynb"))

# course_lib definitions that a reference calls and a student may read, by qualified name, and why: none of them
# holds what its exercise asks the student to build.
GIVEN = {
    "course_lib.nf4.check_blocksize": "argument checking: a blocksize that is not a positive even integer stops",
    "course_lib.nf4.nf4_code": "NF4's 16 levels, which exercise 1 gives as its table NF4 (published values)",
    "course_lib.nf4.dynamic_code": "bitsandbytes' 8-bit code book, which the given storage quantises the scales with",
    "course_lib.nf4.CompressedAbsmax": "the named tuple (codes, scales, offset) that double quantisation returns",
    "course_lib.nf4.pack_4bit": "QLoRA's storage, which notebook 12 gives: two 4-bit codes a byte",
    "course_lib.nf4.unpack_4bit": "QLoRA's storage, which notebook 12 gives: the codes back from their bytes",
    "course_lib.nf4.compress_absmax": "QLoRA's storage, which notebook 12 gives: the scales in 8 bits",
    "course_lib.nf4.decompress_absmax": "QLoRA's storage, which notebook 12 gives: the scales back from 8 bits",
    "course_lib.train.rank_and_world": "the rank and world size of the process group (dist.get_rank and its size)",
    "course_lib.parallel.cp._rank_world": "the rank and world size of the process group, (0, 1) without one",
    "course_lib.parallel.ep._rank_world": "the rank and world size of the process group, (0, 1) without one",
    "course_lib.parallel.tp._world": "the world size of the tensor-parallel group, 1 without one",
    "course_lib.fp8.check_fp8_dtype": "argument checking: a name or dtype that is not FP8 stops",
    "course_lib.parallel.tp.split_size": "argument checking: n // world, or what to change when it does not divide",
    "course_lib.parallel.cp._check": "argument checking: the shapes of q, k, v and the global length they make",
    "course_lib.parallel.cp._acc_dtype": "the accumulation dtype, float32 at least (the exercise's text says so)",
    "course_lib.parallel.cp._local_chunks": "where a rank's rows are contiguous: one block, or zig-zag's two halves",
    "course_lib.parallel.cp.block_attention_backward": "one block's attention gradients (softmax backward): the "
                                                      "exercise asks for the ring's forward, not attention's "
                                                      "calculus",
    "course_lib.parallel.ddp._unused_parameters_message": "the text of BucketedDDP's error for a parameter without a "
                                                          "gradient (the exercise asks to raise one naming it)",
}


# ---------------------------------------------------------------- course_lib names

@cache
def definition(qualified: str) -> str | None:
    """The canonical ``module.Name`` of the course_lib function or class ``qualified`` names (through re-exports);
    None for a module, a constant, or anything not defined in course_lib."""
    module, _, name = qualified.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):  # ValueError: no module part ("course_lib" itself)
        return None
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    home = getattr(obj, "__module__", "") or ""
    return f"{home}.{obj.__qualname__}" if home.startswith("course_lib") else None


@cache
def graded() -> dict[str, tuple[str, str]]:
    """``{"course_lib.nf4.quantize_nf4": (assignment, exercise)}`` of every marked definition."""
    return {f"course_lib.{name}": where for name, where in graded_references().items()}


def is_module(qualified: str) -> bool:
    try:
        importlib.import_module(qualified)
    except ImportError:
        return False
    return True


def imported(tree: ast.AST) -> dict[str, str]:
    """``{local name: qualified course_lib name}`` of the course_lib imports in ``tree`` (modules and objects)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "course_lib":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "course_lib"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "course_lib":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def bound(tree: ast.AST, defs: bool = True) -> set[str]:
    """Names that ``tree`` binds itself: assignments, parameters, loop targets, imports of anything but course_lib,
    and (``defs``) its defs and classes."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif defs and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names} - set(imported(node))
    return out


def dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything that is not a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return [node.id, *parts] if isinstance(node, ast.Name) else None


def references(tree: ast.AST, names: dict[str, str], skip: set[str] = frozenset()) -> dict[str, int]:
    """``{canonical course_lib function or class: first line}`` that ``tree`` reads through ``names`` (local name →
    qualified name): a bare name, or attributes of a module (``nf4.nearest_level``, ``parallel.zero.X``)."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        chain = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if not chain or chain[0] in skip or chain[0] not in names or not isinstance(node.ctx, ast.Load):
            continue
        qualified = names[chain[0]]
        for part in chain[1:]:  # follow modules down to the first thing that is not one
            if not is_module(qualified):
                break
            qualified = f"{qualified}.{part}"
        found = definition(qualified)
        if found:
            out.setdefault(found, node.lineno)
    return out


def parse(code: str) -> ast.Module:
    """A cell's code, IPython's magic and shell lines commented out."""
    return ast.parse("\n".join("#" + ln if ln.lstrip().startswith(("%", "!")) else ln for ln in code.splitlines()))


# ---------------------------------------------------------------- notebooks

def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def given(cell: dict) -> bool:
    """A read-only cell the notebook hands out (a table, a helper): locked, and not a test."""
    return cell["cell_type"] == "code" and bool(nbgrader(cell).get("locked")) and not nbgrader(cell).get("grade")


@dataclass
class Cell:
    assignment: str
    index: int
    kind: str  # "solution", "given" or "code" (a demonstration, a setup cell, a test cell)
    exercise: str | None  # the solution cell's grade_id, or the exercise it comes before
    refs: dict[str, int]  # canonical course_lib name -> line


@cache
def notebook_cells() -> tuple[list[Cell], dict[tuple[str, str], str]]:
    """Every code cell of every solutions notebook with the course_lib names it reads, and each exercise's text:
    ``{(assignment, exercise): the markdown and given cells since the previous solution cell}``."""
    cells, texts = [], {}
    for path in NOTEBOOKS:
        assignment, names, text = path.parent.name, {}, []
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown" or given(cell):
                text.append(source(cell))
            if cell["cell_type"] != "code":
                continue
            tree = parse(source(cell))
            here = {**names, **imported(tree)}
            kind = "solution" if nbgrader(cell).get("solution") else "given" if given(cell) else "code"
            exercise = nbgrader(cell).get("grade_id") if kind == "solution" else None
            cells.append(Cell(assignment, i, kind, exercise, references(tree, here, skip=bound(tree))))
            if kind == "solution":
                texts[(assignment, exercise)] = "\n".join(text)
                text = []
            names = {k: v for k, v in here.items() if k not in bound(tree) or k in imported(tree)}  # rebound here
    return cells, texts


def named_in(text: str, qualified: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(qualified.rpartition('.')[2])}\b", text) is not None


def verdict(qualified: str, assignment: str, exercise: str, texts: dict) -> str | None:
    """None when ``qualified`` may be read by the student doing ``exercise``; else why not, and what to do."""
    if qualified in graded() or qualified in GIVEN or named_in(texts.get((assignment, exercise), ""), qualified):
        return None
    module, _, name = qualified.rpartition(".")
    return (f"{qualified} is readable in the student edition: mark it '# graded: {assignment} {exercise}' on the "
            f"line above its def in {module.replace('.', '/')}.py, name {name} in the exercise's text, or add it to "
            "GIVEN with the reason a student may read it")


# ---------------------------------------------------------------- course_lib's references

@cache
def module_names(module: str) -> tuple[ast.Module, dict[str, str]]:
    """A course_lib module's tree and its top-level names that are course_lib's: its own defs and its imports."""
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(), str(path))
    own = {n.name: f"{module}.{n.name}" for n in tree.body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    top = {n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    return tree, {**{k: v for n in top for k, v in imported(n).items()}, **own}


def reference_calls(qualified: str) -> dict[str, int]:
    """What course_lib's reference ``qualified`` (a marked top-level def or class) reads of course_lib, itself aside."""
    module, _, name = qualified.rpartition(".")
    tree, names = module_names(module)
    node = next(n for n in tree.body if getattr(n, "name", None) == name)
    found = references(node, names, skip=bound(node, defs=False))
    found.pop(qualified, None)
    return found


# ---------------------------------------------------------------- the rule

def test_what_a_solution_cell_calls_in_course_lib_is_stubbed_named_or_given():
    cells, texts = notebook_cells()
    bad = [f"{c.assignment} cell {c.index} ({c.exercise}), line {line}: {why}"
           for c in cells if c.kind == "solution" for ref, line in c.refs.items()
           if (why := verdict(ref, c.assignment, c.exercise, texts))]
    assert not bad, "a solution cell calls course_lib code that a student can read:\n  " + "\n  ".join(bad)


def test_what_course_libs_references_call_is_stubbed_named_or_given():
    _, texts = notebook_cells()
    bad = []
    for qualified, (assignment, exercise) in sorted(graded().items()):
        for ref, line in reference_calls(qualified).items():
            if why := verdict(ref, assignment, exercise, texts):
                bad.append(f"{qualified} (line {line} of its module) calls {why}")
    assert not bad, "a graded reference calls course_lib code that a student can read:\n  " + "\n  ".join(bad)


def test_no_cell_a_student_runs_calls_a_stub():
    """Outside the solution cells every cell runs in the student's kernel on the student edition, where a graded
    reference raises NotImplementedError: a demonstration runs on the student's code, or on course_lib's instruments."""
    cells, _ = notebook_cells()
    bad = [f"{c.assignment} cell {c.index} ({c.kind}), line {line}: calls {ref}, a stub in the student edition "
           f"(notebook {graded()[ref][0]}'s exercise {graded()[ref][1]})"
           for c in cells if c.kind != "solution" for ref, line in c.refs.items() if ref in graded()]
    assert not bad, "\n  ".join(["cells that cannot run in the student's kernel:", *bad])


def test_the_rule_sees_a_call_through_a_module_and_a_name():
    """The parse: a call through a module alias and an imported name are found, a local name that shadows one is
    not; a name is given when the exercise's text names it, qualified or not."""
    tree = ast.parse("import course_lib.nf4 as nf4\nfrom course_lib.nf4 import nf4_code, fp4_code\n"
                     "def f(x, fp4_code):\n    y = x\n    return nf4.relative_rms_error(y, nf4_code()) + fp4_code(y)\n")
    assert references(tree, imported(tree), skip=bound(tree)) == {
        "course_lib.nf4.relative_rms_error": 5, "course_lib.nf4.nf4_code": 5}
    assert verdict("course_lib.nf4.relative_rms_error", "12_qlora", "nf4_quantize", {}) is not None
    assert verdict("course_lib.nf4.relative_rms_error", "12_qlora", "nf4_quantize",
                   {("12_qlora", "nf4_quantize"): "use `nf4.relative_rms_error`"}) is None


# ---------------------------------------------------------------- visible checks print no answer

def compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


def solution_lines(path: Path) -> dict[str, list[str]]:
    """Per exercise, the solution lines (25 characters or more without spaces) its exercise's text does not give."""
    _, texts = notebook_cells()
    out: dict[str, list[str]] = {}
    for cell in json.loads(path.read_text())["cells"]:
        if not nbgrader(cell).get("solution"):
            continue
        exercise = nbgrader(cell)["grade_id"]
        given_text = compact(texts.get((path.parent.name, exercise), ""))
        lines = [compact(ln) for ln in source(cell).splitlines() if not ln.strip().startswith(("#", "def ", "class "))]
        out[exercise] = [ln for ln in lines if len(ln) >= 25 and ln not in given_text]
    return out


def messages(path: Path) -> list[tuple[int, str]]:
    """The text of every assert message and raised exception of a check module (an f-string's literal parts)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        said = node.msg if isinstance(node, ast.Assert) else node.exc if isinstance(node, ast.Raise) else None
        if said is not None:
            text = "".join(n.value for n in ast.walk(said) if isinstance(n, ast.Constant) and isinstance(n.value, str))
            out.append((node.lineno, text))
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.parent.name for p in NOTEBOOKS])
def test_no_visible_check_prints_a_solution_line(path):
    check = ROOT / "course_grader" / "checks" / f"nb{path.parent.name[:2]}.py"
    assert check.exists(), f"{path.parent.name} has graded cells and no visible checks at {check}"
    said = messages(check)
    bad = [f"{check.name}:{line}: {line_of_answer!r} ({exercise})" for exercise, lines in solution_lines(path).items()
           for line_of_answer in lines for line, text in said if line_of_answer in compact(text)]
    assert not bad, ("a visible check's message gives a solution line (say what is wrong instead):\n  "
                     + "\n  ".join(bad))


def test_the_resume_judge_says_what_is_wrong_with_a_shard_that_requires_grad_and_gives_no_answer():
    """Notebook 09's visible state test: a shard made with requires_grad_() trains right and breaks the given
    load_state_dict; the judge names that, and none of the solution's lines."""
    from course_grader.checks import nb09

    run = {"load_error": "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation.",
           "shards_require_grad": True}
    with pytest.raises(AssertionError) as raised:
        nb09.judge_resumed([run], "1 rank, AdamW in two groups", saved_after=0, nprocs=1)
    said = str(raised.value)
    assert "requires_grad_()" in said and "load_state_dict" in said and "plain fp32 tensor" in said, said
    lines = solution_lines(ROOT / "solutions" / "09_deepspeed_zero" / "09_deepspeed_zero.ipynb")["ShardedOptimizer"]
    assert lines and not [ln for ln in lines if ln in compact(said)]


# ---------------------------------------------------------------- what a check forbids is absent

# course_lib definitions that a check forbids while the student's code runs and that the student edition keeps
# (no ``# graded:`` marker), by qualified name, and why they stay. A forbidden object that is present can be copied
# (``exec`` of its source gives a new function that ``forbid`` does not know), so each one here is an answer a
# student can read and copy: it stays only because a cell the student runs, a module those cells run, or a check
# (outside ``forbid``, in the grading process, which runs the student edition) needs it working. "Cell N" is the
# index of a cell of the notebook (solutions/ and notebooks/ number them alike).
GIVEN_FORBIDDEN = {
    # notebook 00 (llama_param_count, training_memory, saved_activation_bytes)
    "course_lib.models.llama_num_parameters": "the parameter count of every notebook's model table: notebook 08's "
                                              "cell 2, 09's cell 4, 10's cells 12 and 22, 11's cells 31 and 35; "
                                              "recipe, parallel.fsdp_torch's sweep, apps.benchmark and "
                                              "apps.size_sweep count with it; checks/nb08.py (outside forbid) too",
    "course_lib.models.count_parameters": "notebook 00's cells 2, 6 and 29 and notebook 04's cell 2 count a "
                                          "model's parameters with it; lora counts trainable ones with it; "
                                          "checks/nb00.py's judge (outside forbid) too",
    "course_lib.models.build_llama": "the course's Llama: notebook 00's cells 6 and 20, 03's cell 17, 04's cell "
                                     "2, 10's cell 20, 13's cell 11 and 14's cell 19 build it, as does every technique "
                                     "module and the checks of notebooks 00, 03, 04, 08 and 11 (outside forbid)",
    "course_lib.models.empty_llama": "notebook 00's cells 2 and 29 and parallel.fsdp_torch (its meta-device build) "
                                     "make the shapes-only Llama with it; checks/nb00_hidden.py (outside forbid) "
                                     "too",
    "course_lib.memory.estimate_model_state": "notebook 04's cell 12 and notebook 08's cell 6 print its "
                                              "estimates; recipe and parallel.fsdp_torch's sweep (notebook 08's "
                                              "cells 2 and 4) call it",
    "course_lib.memory.training_bytes_per_param": "estimate_model_state (given, above) computes with it",
    "course_lib.memory.model_state_bytes": "notebook 01's cell 29 and apps.finetune (notebooks 11 and 12) measure "
                                           "a model's weights, gradients and optimizer states with it",
    "course_lib.memory.measure_training_step": "notebook 00's cells 20 and 27 (the estimate against what a step "
                                               "holds) measure with it; checks/nb00.py (outside forbid) too",
    "course_lib.memory.activation_bytes": "notebook 03's cell 27 and notebook 04's cells 9, 14 and 25 measure "
                                          "saved activations with it, as do checkpointing and parallel.cp_cost; "
                                          "checks/nb04.py and checks/nb00_hidden.py (outside forbid) too",
    "course_lib.memory.SavedTensorMeter": "notebook 15's cell 19 (what each pipeline schedule saves) measures with "
                                          "it, as do parallel.pp_torch and parallel.cp_cost (notebooks 15 and 16)",
    "course_lib.memory.saved_bytes_by_dtype": "notebook 01's cell 6 (what autocast saves, by dtype) runs it",
    "course_lib.memory.saved_bytes_by_part": "notebook 04's cells 4, 7 and 14 (what each part of a layer saves) run "
                                             "it",
    # notebook 01 (DynamicLossScaler, amp_train_step)
    "course_lib.precision.make_scaler": "notebook 01's cell 6 (fp16 with torch's scaler, before the exercise) and "
                                        "checks/nb01.py's reference step (outside forbid) make the scaler with it",
    "course_lib.train.train_step": "the one step every notebook trains with: notebook 01's cells 6, 21, 29 and 31, "
                                   "03's 21 and 27, 05's 4, 06's 25, 10's 20, and recipe, parallel.ddp_torch, zero, "
                                   "zero_deepspeed, apps.finetune and apps.size_sweep; checks/nb01.py (outside "
                                   "forbid) too",
    "course_lib.train.fit": "the course's training loop: notebook 01's cells 27 and 33 and 03's cell 11 run it, as "
                            "does every technique module's train (ddp_torch, fsdp_torch, zero_deepspeed, pp_torch, cp, "
                            "tp_torch, fp8_compute, qlora, apps.finetune)",
    # notebook 02 (DelayedScalingFP8)
    "course_lib.fp8.current_scaler": "notebook 02's cell 17 (current against delayed scaling on a drifting "
                                     "stream) runs it",
    "course_lib.fp8.quantize": "fp8_compute's scaled matmul (notebook 02's cells 8, 11 and 19) quantises with it; "
                               "checks/nb02.py and checks/nb02_hidden.py (outside forbid) too",
    "course_lib.fp8.dequantize": "fp8_compute's emulated matmul (notebook 02's cell 8) dequantises with it",
    "course_lib.fp8.scale_for": "fp8_compute's scaled matmul (notebook 02's cell 8) scales its operands with it",
    # notebook 03 (accumulate_gradients, accumulate_tokens, micro_step_context)
    "course_lib.train.split_batch": "train_step (given, above) and parallel.zero_deepspeed's step cut a batch "
                                    "into micro-batches with it",
    "course_lib.train.token_weights": "train_step's token-weighted accumulation (given, above) weighs its "
                                      "micro-batches with it",
    "course_lib.train.grad_sync_context": "train_step (given, above) skips DDP's gradient sync on all but the last "
                                          "micro-step with it",
    "course_lib.loss.scored_tokens": "token_weights (given, above) and apps.finetune count a batch's scored "
                                     "tokens with it",
    # notebook 04 (checkpointed)
    "course_lib.checkpointing.apply_policy": "notebook 04's cells 4, 9, 14 and 25 (memory and time of each "
                                             "checkpointing policy) run it",
    "course_lib.checkpointing.checkpoint_layers": "apply_policy (given, above), recipe and apps.size_sweep "
                                                  "checkpoint a model's layers with it",
    "course_lib.checkpointing.CheckpointedBlock": "notebook 04's cell 18 uses it, and checkpoint_layers (given, "
                                                  "above) wraps each layer in it",
    # notebook 06 (rank_batches, average_gradients)
    "course_lib.distributed.sharded_loader": "notebook 06's cell 9 (DistributedSampler's shards and set_epoch, a "
                                             "demonstration before the exercise) runs it",
    "course_lib.distributed.step_batches": "each rank's share of a global batch in parallel.ddp_torch's train "
                                           "(notebook 06's cells 16 and 22), parallel.zero, parallel.zero_deepspeed "
                                           "(notebooks 09 and 10) and apps.finetune",
    # notebook 08 (shard_state_bytes, apply_fsdp, ShardedModule)
    "course_lib.parallel.fsdp_torch.apply_fsdp": "parallel.fsdp_torch's train, which notebook 08's sweep (cells 2 "
                                                 "and 4) runs, wraps the model with it",
    "course_lib.distributed.rank_slice": "checks/nb08.py slices fully_shard's reference gradients with it (outside "
                                         "forbid) when it grades ShardedModule, in the grading process",
    # notebook 09 (ShardedOptimizer, make_ds_config)
    "course_lib.parallel.zero_deepspeed.ds_config": "notebook 09's cell 11 shows the config it writes; "
                                                    "zero_deepspeed's train and sweep (notebook 09's cells 17 "
                                                    "and 21, notebook 10's cells 4 and 8) and apps.size_sweep "
                                                    "configure DeepSpeed with it",
    # notebook 11 (response_labels, LoRALinear, lora_params)
    "course_lib.instruct.tokenize_example": "notebook 11's cells 8 and 14 and notebook 12's cell 4 tokenize with "
                                            "it, as do apps.finetune and apps.benchmark; checks/nb11.py (outside "
                                            "forbid) too",
    "course_lib.instruct.pad_batch": "notebook 11's cells 14 and 33 and notebook 12's cells 21 and 23 batch examples "
                                     "with it, as does apps.finetune's collate; checks/nb11.py (outside forbid) too",
    "course_lib.instruct.pack_examples": "notebook 11's cell 14 (padding against packing) and apps.benchmark pack "
                                         "with it",
    "course_lib.lora.apply_lora": "apps.finetune (notebook 11's cell 24, notebook 12's cell 23), qlora and "
                                  "apps.benchmark put adapters on a model with it; checks/nb11.py (outside forbid) "
                                  "too",
    "course_lib.lora.lora_linear": "peft's own LoRA layer, the reference checks/nb11.py and checks/nb12.py compare "
                                   "the student's layers with (outside forbid); a copy builds peft's layer, which "
                                   "the checks forbid as well",
    # notebook 12 (nf4_quantize, QLoRALinear)
    "course_lib.nf4.round_trip_model": "notebook 12's cell 21 (each format's loss on a model) runs it with the "
                                       "student's round trip",
    "course_lib.nf4.stored_bytes": "checks/nb12_hidden.py (outside forbid) gives the bytes a QLoRALinear stores "
                                   "with it",
    # notebook 13 (chunked_cross_entropy)
    "course_lib.loss.lm_loss": "the recipe's loss (course_lib.recipe), which apps.finetune and apps.benchmark train "
                               "with (notebooks 11 to 13); notebook 13's cell 12 sets it beside the plain loss",
    "course_lib.loss.chunked_lm_loss": "lm_loss (given, above) computes its loss from the hidden states with it",
    "course_lib.loss._ChunkedLinearCrossEntropy": "chunked_lm_loss (given, above) is this autograd function applied "
                                                  "to the hidden states and the LM head's weight",
    # notebooks 14 (tensor_parallel_pair) and 15 (one_f_one_b_order, run_1f1b)
    "course_lib.parallel.tp.parallelize_mlp": "parallelize_llama_by_hand splits each MLP with it: parallel.tp_torch's "
                                              "compare (notebook 14's cell 13) runs it with the student's layers",
    "course_lib.parallel.pp.gpipe_order": "notebook 15's cell 19 (what GPipe keeps in flight) runs it; "
                                          "checks/nb15_hidden.py (outside forbid) too",
    "course_lib.parallel.pp.torch_order": "parallel.pp_torch's train (notebook 15's cell 4) reads the order torch "
                                          "planned with it",
    "course_lib.parallel.pp_torch.train": "notebook 15's pipeline sweep (cell 4, pp_torch.sweep) runs it; "
                                          "checks/nb15.py (outside forbid) runs torch's schedules with it",
    "course_lib.parallel.pp_torch.naive_step": "parallel.pp_torch's train runs its naive schedule with it (notebook "
                                               "15's cell 4)",
    # notebooks 16 (ring_attention) and 17 (expert_parallel)
    "course_lib.parallel.cp.ring_attention": "notebook 16's cell 11, parallel.cp's Llama and parallel.cp_cost "
                                             "(cells 13 and 20) run the student's ring through it",
    "course_lib.parallel.cp.RingAttention": "ring_attention (given, above) applies it",
    "course_lib.parallel.cp.tile_mask": "gathered_backward, the backward ring_attention runs behind the student's "
                                        "ring (notebook 16's cells 11 to 17), masks with it",
}
CHECKS = ROOT / "course_grader" / "checks"


def forbid_calls(tree: ast.AST) -> list[ast.Call]:
    """Every ``forbid(...)`` call of a module, written ``forbid(...)`` or ``grading.forbid(...)``."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == "forbid" or getattr(n.func, "attr", None) == "forbid")]


@cache
def forbidden() -> tuple[dict[str, list[str]], list[str]]:
    """``{"course_lib.memory.activation_bytes": ["nb00.py:95", ...]}`` of every course_lib function or class a check
    passes to ``forbid`` (a name, an attribute, a ``*TUPLE``), and the arguments that cannot be read: each is
    evaluated in its check module's namespace, so what a check forbids must be reachable from its module's top
    level (a module-level tuple, as every check writes it)."""
    found: dict[str, list[str]] = {}
    unreadable = []
    for path in sorted(CHECKS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        calls = forbid_calls(tree)
        if not calls:
            continue
        space = vars(importlib.import_module(f"course_grader.checks.{path.stem}"))
        for call in calls:
            where = f"{path.name}:{call.lineno}"
            for arg in call.args:
                expr = arg.value if isinstance(arg, ast.Starred) else arg
                try:
                    value = eval(compile(ast.Expression(expr), where, "eval"), space)  # names only: no call runs
                except Exception as err:  # a local name, a call: reported below
                    unreadable.append(f"{where}: {ast.unparse(arg)} ({type(err).__name__}: {err})")
                    continue
                for obj in value if isinstance(arg, ast.Starred) else (value,):
                    home = getattr(obj, "__module__", None) or ""
                    if home.split(".")[0] != "course_lib":
                        continue  # torch's, peft's, deepspeed's: no student edition of those
                    name = f"{home}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
                    found.setdefault(name, []).append(where)
    return found, unreadable


def stub_kind(node: ast.AST) -> bool:
    """Whether a definition of the student edition is edition.py's stub: a function whose body (its docstring
    aside) is one ``raise NotImplementedError(...)``; a class whose only member is such an ``__init__``."""
    def raises(body: list) -> bool:
        body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        return (len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call)
                and getattr(body[0].exc.func, "id", None) == "NotImplementedError")

    if isinstance(node, ast.ClassDef):
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        return (len(body) == 1 and isinstance(body[0], ast.FunctionDef) and body[0].name == "__init__"
                and raises(body[0].body))
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and raises(node.body)


@pytest.fixture(scope="module")
def grading_course_lib() -> Path:
    """The student edition's course_lib, the one the grading process imports (edition.for_grading())."""
    from course_grader.edition import for_grading

    return for_grading() / "course_lib"


def test_every_check_s_forbidden_argument_is_readable():
    _, unreadable = forbidden()
    assert not unreadable, ("forbid() arguments this test cannot read (name what a check forbids in a module-level "
                            "tuple of its check module):\n  " + "\n  ".join(unreadable))


def test_what_a_check_forbids_is_stubbed_or_given(grading_course_lib):
    """Answers are absent, not forbidden, while student code runs: every course_lib object a check forbids is a
    stub in the student edition (which the grading process runs), or on GIVEN_FORBIDDEN with why it stays."""
    found, _ = forbidden()
    assert found, "no course_lib object found in the checks' forbid() calls: the scan is broken"
    bad = []
    for name, where in sorted((k, sorted(set(v))) for k, v in found.items()):
        module, _, short = name.removeprefix("course_lib.").rpartition(".")
        if name in graded():
            path = grading_course_lib / (module.replace(".", "/") + ".py")
            tree = ast.parse(path.read_text(), str(path))
            node = next((n for n in tree.body if getattr(n, "name", None) == short), None)
            if node is None or not stub_kind(node):
                bad.append(f"{name} (forbidden at {', '.join(where)}) is marked '# graded:' but is not a stub in "
                           f"the student edition's {path}")
        elif name not in GIVEN_FORBIDDEN:
            bad.append(f"{name} (forbidden at {', '.join(where)}) is present in the student edition, so a student "
                       f"can copy it: mark it '# graded: <assignment> <exercise>' on the line above its def in "
                       f"course_lib/{module.replace('.', '/')}.py (when no cell a student runs, no module those "
                       "cells run and no check outside forbid needs it), or add it to GIVEN_FORBIDDEN with what "
                       "needs it")
    assert not bad, "a check forbids course_lib code the student edition keeps:\n  " + "\n  ".join(bad)


def test_given_forbidden_lists_only_forbidden_and_unstubbed_objects():
    """The list says why each forbidden answer stays: an entry no check forbids, or one that is now a stub, is
    stale; every reason says what needs it."""
    found, _ = forbidden()
    stale = [f"{name}: no check forbids it" for name in GIVEN_FORBIDDEN if name not in found]
    stale += [f"{name}: a stub now (# graded: {' '.join(graded()[name])})" for name in GIVEN_FORBIDDEN
              if name in graded()]
    stale += [f"{name}: no reason" for name, why in GIVEN_FORBIDDEN.items() if len(why.split()) < 4]
    assert not stale, "stale GIVEN_FORBIDDEN entries (remove them):\n  " + "\n  ".join(stale)


def test_the_scan_reads_a_starred_tuple_a_name_and_an_attribute():
    """The parse: ``forbid(*TUPLE, name, module.attr, namespace=ns)`` yields its three positional arguments and no
    keyword argument; ``grading.forbid`` counts too."""
    tree = ast.parse("with forbid(*A, b, m.c, namespace=ns):\n    pass\nwith grading.forbid(d):\n    pass\n"
                     "forbidden(e)\n")
    calls = forbid_calls(tree)
    assert [[ast.unparse(a) for a in c.args] for c in calls] == [["*A", "b", "m.c"], ["d"]]
    stub = ast.parse("def f(x):\n    '''doc'''\n    raise NotImplementedError('f')\n"
                     "class C(B):\n    '''doc'''\n    def __init__(self, *a, **k):\n"
                     "        raise NotImplementedError('C')\n"
                     "def g(x):\n    return x\n").body
    assert [stub_kind(n) for n in stub] == [True, True, False]
