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

from course_lib.apps.edition import graded_references

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "solutions").glob("*/*.ipynb"))

# course_lib definitions that a reference calls and a student may read, by qualified name, and why: none of them
# holds what its exercise asks the student to build.
GIVEN = {
    "course_lib.nf4.check_blocksize": "argument checking: a blocksize that is not a positive even integer stops",
    "course_lib.nf4.nf4_code": "NF4's 16 levels, which exercise 1 gives as its table NF4 (published values)",
    "course_lib.nf4.dynamic_code": "bitsandbytes' 8-bit code book, which exercise 2 gives as its table DYNAMIC",
    "course_lib.nf4.CompressedAbsmax": "the named tuple (codes, scales, offset) that double quantisation returns",
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
    assert verdict("course_lib.nf4.relative_rms_error", "12_qlora_recipe", "nf4_quantize", {}) is not None
    assert verdict("course_lib.nf4.relative_rms_error", "12_qlora_recipe", "nf4_quantize",
                   {("12_qlora_recipe", "nf4_quantize"): "use `nf4.relative_rms_error`"}) is None


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
    check = ROOT / "course_lib" / "checks" / f"nb{path.parent.name[:2]}.py"
    if not check.exists():
        pytest.skip(f"no {check.name}")
    said = messages(check)
    bad = [f"{check.name}:{line}: {line_of_answer!r} ({exercise})" for exercise, lines in solution_lines(path).items()
           for line_of_answer in lines for line, text in said if line_of_answer in compact(text)]
    assert not bad, ("a visible check's message gives a solution line (say what is wrong instead):\n  "
                     + "\n  ".join(bad))


def test_the_resume_judge_says_what_is_wrong_with_a_shard_that_requires_grad_and_gives_no_answer():
    """Notebook 09's visible state test: a shard made with requires_grad_() trains right and breaks the given
    load_state_dict; the judge names that, and none of the solution's lines."""
    from course_lib.checks import nb09

    run = {"load_error": "RuntimeError: a leaf Variable that requires grad is being used in an in-place operation.",
           "shards_require_grad": True}
    with pytest.raises(AssertionError) as raised:
        nb09.judge_resumed([run], "2 ranks, AdamW in two groups", saved_after=0)
    said = str(raised.value)
    assert "requires_grad_()" in said and "load_state_dict" in said and "plain fp32 tensor" in said, said
    lines = solution_lines(ROOT / "solutions" / "09_deepspeed_zero" / "09_deepspeed_zero.ipynb")["ShardedOptimizer"]
    assert lines and not [ln for ln in lines if ln in compact(said)]
