"""The student edition (course_grader/edition.py): what a student receives holds no solution, no hidden test and no
graded reference, and the grading kernel's course_lib is that same stubbed package.

The scan builds the real edition and looks in every file of it for every solution body and hidden test of
solutions/. Its summary (which solution line matched which file) prints with `pytest -rP` or `-s`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from course_grader import edition
from course_grader.edition import MARKER_FILE, MarkerError, build_student_edition, for_grading, graded_references
from course_grader.release import assignments

ROOT = Path(__file__).resolve().parent.parent
STDLIB_ONLY = [sys.executable, "-S"]  # no site-packages: the script must run on a bare python3, before any setup

# Exercises whose solution lines may match the student edition's course_lib, and why. The course measures with
# these instruments in every notebook, so course_lib keeps them; the exercise asks for something the instrument
# alone does not give. Only course_lib/ files are excused: a match in a notebook or the README still fails.
# Provisional (what the first scan found); the lead settles the list with each notebook's engineer.
KEPT = {
    ("00_orientation", "llama_param_count"):
        "course_lib.models counts a Llama config's parameters for every notebook's model table",
    ("03_gradient_accumulation", "micro_step_context"):
        "course_lib.train.train_step, the one step every notebook trains with, skips the sync on all but the last "
        "micro-step (model.no_sync)",
    ("09_deepspeed_zero", "make_ds_config"):
        "course_lib.parallel.zero_deepspeed.ds_config writes the DeepSpeed config that notebook 09 shows and every "
        "ZeRO run (and the size sweep) launches with; one dict key matches the exercise's, whose arithmetic and "
        "errors are graded by behaviour",
    ("13_fast_recipe", "chunked_cross_entropy"):
        "course_lib.loss's chunked loss is the recipe's, which notebooks 11 to 13 train with (it computes each chunk's "
        "gradients in forward; the exercise's reference recomputes them in backward); the checks forbid it, and one "
        "accumulator line matches",
}
# Exercises whose solution lines may match a visible check's peer (course_grader.peer): the grader's own rank plays
# the contract's side of the student's collectives, in the student's own test too, so the visible check holds it.
# Only that check's file is excused.
PEER_SIDE = {
    ("07_ddp_reducer", "BucketedDDP"):
        ("course_grader/checks/nb07.py", "rank 0 (the grader's) broadcasts its weights as wrapping does, the "
         "contract's one line, then all-reduces torch's buckets after its backward; it has neither the hooks, nor "
         "the async launches, nor the unused-parameter error the exercise is graded on"),
}
# Idioms any training code writes; a match on one of them gives no exercise away.
COMMON = {
    "for p in model.parameters():",
    "optimizer.zero_grad(set_to_none=True)",
    "rank, world = dist.get_rank(), dist.get_world_size()",
    "return contextlib.nullcontext()",
    "for layer in model.model.layers:",
    "d, ffn = config.hidden_size, config.intermediate_size",
}
MIN_LINE = 25  # a shorter line is too common to say anything (`return x`, `loss.backward()`)
TOP = {"notebooks", "course_lib", "course_grader", "docker", "pyproject.toml", "environment.yml", "Makefile",
       "README.md", ".gitignore", MARKER_FILE}


# ---------------------------------------------------------------- what solutions/ holds

@dataclass(frozen=True)
class Secret:
    """A solution body or a hidden-test region of one cell of solutions/."""
    assignment: str
    exercise: str  # the grade_id of the solution cell it belongs to (hidden tests: the exercise they follow)
    kind: str  # "solution" or "hidden test"
    cell: str  # the grade_id of the cell that holds it
    lines: tuple[str, ...]  # its distinctive lines, stripped
    body: str  # the whole region, normalised (stripped, non-empty lines)


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def normalised(text: str) -> str:
    return "\n".join(ln.strip() for ln in text.splitlines() if ln.strip())


def visible_code(root: Path) -> set[str]:
    """Stripped lines of the release notebooks' code: what every student sees anyway."""
    return {ln.strip() for p in (root / "notebooks").glob("*.ipynb") for c in json.loads(p.read_text())["cells"]
            if c["cell_type"] == "code" for ln in source(c).splitlines()}


def docstring_lines(text: str) -> set[int]:
    """Line numbers of the docstrings of a cell's code (prose, not an answer)."""
    try:
        tree = ast.parse("\n".join("#" + ln if ln.lstrip().startswith(("%", "!")) else ln for ln in text.splitlines()))
    except SyntaxError:
        return set()
    out = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return out


def distinctive(line: str, visible: set[str]) -> bool:
    """The rule: at least MIN_LINE characters, code (not a comment, docstring, import, def/class header or bare
    `return name`), not a COMMON idiom, and not already in the release notebooks' visible code."""
    return (len(line) >= MIN_LINE and not line.startswith(("#", "def ", "class ", "async def "))
            and not re.match(r"(import|from)\s", line) and not re.fullmatch(r"return\s+[\w.]+", line)
            and line not in COMMON and line not in visible)


def regions(text: str, begin: str, end: str) -> list[list[tuple[int, str]]]:
    """The (line number, line) runs between ``begin`` and ``end`` marker lines of a cell."""
    out, current = [], None
    for i, ln in enumerate(text.splitlines(), 1):
        if ln.strip().startswith(begin):
            current = []
        elif ln.strip().startswith(end) and current is not None:
            out.append(current)
            current = None
        elif current is not None:
            current.append((i, ln))
    return out


def secrets(root: Path = ROOT) -> list[Secret]:
    """Every solution body and hidden-test region of solutions/*/*.ipynb, with its distinctive lines."""
    visible, out = visible_code(root), []
    for nb_path in sorted((root / "solutions").glob("*/*.ipynb")):
        exercise = None
        for cell in json.loads(nb_path.read_text())["cells"]:
            meta = cell["metadata"].get("nbgrader", {})
            exercise = meta["grade_id"] if meta.get("solution") else exercise
            text, docs = source(cell), docstring_lines(source(cell))
            for kind, begin, end in (("solution", "### BEGIN SOLUTION", "### END SOLUTION"),
                                     ("hidden test", "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")):
                for region in regions(text, begin, end):
                    lines = tuple(dict.fromkeys(ln.strip() for i, ln in region
                                                if i not in docs and distinctive(ln.strip(), visible)))
                    out.append(Secret(nb_path.parent.name, exercise, kind, meta.get("grade_id", "?"), lines,
                                      normalised("\n".join(ln for _, ln in region))))
    return out


# ---------------------------------------------------------------- what the edition holds

def edition_texts(folder: Path) -> dict[str, str]:
    """Every text file of a folder by relative path; a notebook as its cells' sources (JSON-decoded)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        try:
            text = p.read_text() if p.is_file() else None
        except UnicodeDecodeError:
            continue
        if text is not None and p.suffix == ".ipynb":
            text = "\n".join(source(c) for c in json.loads(text)["cells"])
        if text is not None:
            out[p.relative_to(folder).as_posix()] = text
    return out


@dataclass(frozen=True)
class Hit:
    secret: Secret
    what: str  # the distinctive line, or "the whole hidden-test region"
    file: str

    @property
    def kept(self) -> bool:
        s = self.secret
        if s.kind == "solution" and PEER_SIDE.get((s.assignment, s.exercise), ("",))[0] == self.file:
            return True
        return s.kind == "solution" and (s.assignment, s.exercise) in KEPT and self.file.startswith("course_lib/")

    def __str__(self) -> str:
        s = self.secret
        return f"{s.assignment} {s.exercise} ({s.kind}, cell {s.cell}): {self.what!r} is in {self.file}"


def scan(folder: Path, root: Path = ROOT) -> list[Hit]:
    """Every distinctive solution or hidden-test line, and every whole hidden-test region, found in ``folder``."""
    files = {rel: ({ln.strip() for ln in text.splitlines()}, normalised(text))
             for rel, text in edition_texts(folder).items()}
    hits = []
    for s in secrets(root):
        for rel, (lines, text) in files.items():
            hits += [Hit(s, line, rel) for line in s.lines if line in lines]
            if s.kind == "hidden test" and len(s.body) >= MIN_LINE and s.body in text:
                hits.append(Hit(s, "the whole hidden-test region", rel))
    return hits


def summary(hits: list[Hit]) -> str:
    by_file: dict[tuple, list[str]] = {}
    for h in hits:
        by_file.setdefault((h.secret.assignment, h.secret.exercise, h.secret.kind, h.file, h.kept), []).append(h.what)
    return "\n".join(f"{'KEPT ' if kept else ''}{a} {e} ({kind}) -> {f}: {len(whats)} line(s), e.g. {whats[0]!r}"
                     for (a, e, kind, f, kept), whats in sorted(by_file.items())) or "(no solution line found)"


# ---------------------------------------------------------------- fixtures

def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The student edition, written by the command line on a bare interpreter, with its archive."""
    dest = tmp_path_factory.mktemp("edition") / "student-edition"
    out = run(STDLIB_ONLY + ["course_grader/edition.py", "student", str(dest), "--archive"], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return dest


def course_copy(dest: Path) -> Path:
    """A root with a copy of this repository's course_lib, course_grader and solutions (what the edition is made
    from)."""
    for part in ("course_lib", "course_grader", "solutions", "notebooks"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in edition.STUDENT_FILES + ("Makefile",):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, dest / part)
        elif (ROOT / part).exists():
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / part, dest / part)
    return dest


def files_of(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- the scan

def test_no_solution_line_or_hidden_test_is_in_the_student_edition(built):
    assert set(KEPT) <= {(s.assignment, s.exercise) for s in secrets() if s.kind == "solution"}, \
        "KEPT names no exercise"
    hits = scan(built)
    unused = sorted(set(KEPT) - {(h.secret.assignment, h.secret.exercise) for h in hits if h.kept})
    print("solution and hidden-test lines found in the student edition:\n" + summary(hits)
          + (f"\nKEPT entries that matched nothing (remove them?): {unused}" if unused else ""))
    leaks = [h for h in hits if not h.kept]
    assert not leaks, ("the student edition holds solution code:\n  " + "\n  ".join(map(str, leaks[:30]))
                       + f"\n{'  ...' if len(leaks) > 30 else ''}For a course_lib definition that holds the answer, "
                       "mark it with '# graded: <assignment> <exercise>' on the line above it (the edition stubs it); "
                       "if the course measures with it on purpose, add the exercise to KEPT with the reason."
                       "\nSummary:\n" + summary(hits))


def test_the_scan_finds_an_unmarked_reference_and_not_a_marked_one(tmp_path):
    """A solution cell pasted into course_lib unmarked is found; marked, it is stubbed and the scan is clean."""
    root = course_copy(tmp_path / "course")
    nb = json.loads((ROOT / "solutions/02_fp8/02_fp8.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "DelayedScalingFP8")
    pasted = "import math\n\nimport torch\n\n\n" + source(cell) + "\n"
    name = re.search(r"^class (\w+)", pasted, re.M).group(1)
    (root / "course_lib" / "leak.py").write_text(pasted)
    unmarked = scan(build_student_edition(tmp_path / "unmarked", root=root), root)
    found = [h for h in unmarked if h.file == "course_lib/leak.py"]
    assert found and all(h.secret.exercise == "DelayedScalingFP8" for h in found), summary(unmarked)
    (root / "course_lib" / "leak.py").write_text(pasted.replace(f"class {name}",
                                                                f"# graded: 02_fp8 DelayedScalingFP8\nclass {name}"))
    marked = scan(build_student_edition(tmp_path / "marked", root=root), root)
    assert not [h for h in marked if h.file == "course_lib/leak.py"], summary(marked)


# ---------------------------------------------------------------- the stubs

STUB_CHECK = """
import asyncio, importlib, inspect, json, sys
out = {}
for ref in json.loads(sys.argv[1]):
    module, name = ref.rsplit(".", 1)
    mod = importlib.import_module("course_lib." + module)
    obj = getattr(mod, name)
    try:
        if inspect.isclass(obj):
            obj()
        else:
            sig = inspect.signature(obj)
            args = [None for p in sig.parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
            kwargs = {p.name: None for p in sig.parameters.values()
                      if p.kind == p.KEYWORD_ONLY and p.default is p.empty}
            result = obj(*args, **kwargs)
            asyncio.run(result) if inspect.iscoroutine(result) else None
        out[ref] = ["returned", mod.__file__]
    except NotImplementedError as err:
        out[ref] = [str(err), mod.__file__]
print(json.dumps(out))
"""


def stub_messages(folder: Path, refs: list[str], cwd: Path) -> dict[str, list[str]]:
    """Import each reference from ``folder`` (first on PYTHONPATH) in a fresh interpreter and call it."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    out = run([sys.executable, "-c", STUB_CHECK, json.dumps(refs)], cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_graded_reference_is_a_stub_that_names_its_exercise(built, tmp_path):
    refs = graded_references()
    modules = sorted({r.rsplit(".", 1)[0] for r in refs} | {"fp8"})  # fp8: one module at least, with or without markers
    results = stub_messages(built, sorted(refs), cwd=tmp_path)
    for ref, (assignment, exercise) in refs.items():
        message, module_file = results[ref]
        assert message == (f"course_lib.{ref} is written in notebook {assignment}'s exercise {exercise}: "
                           "use the one you wrote there"), ref
        assert Path(module_file).is_relative_to(built), module_file
    env = {**os.environ, "PYTHONPATH": str(built)}
    imports = "; ".join(f"import course_lib.{m}" for m in modules) + "; import course_lib; print(course_lib.__file__)"
    out = run([sys.executable, "-c", imports], cwd=tmp_path, env=env)
    assert out.returncode == 0 and Path(out.stdout.strip()).is_relative_to(built), out.stderr[-3000:]
    for path in (built / "course_lib").rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


TOY = '''"""A module to stub."""

import dataclasses


# graded: 07_ddp_reducer BucketedDDP
@dataclasses.dataclass
class Buckets(dict):
    """Buckets, in reverse order."""

    cap: int = 25

    def plan(self):
        return [self.cap] * 3


# graded: 06_ddp average_gradients
def average(model,
            world: int = 2,
            *, op: str = "sum") -> dict[str, int]:
    """Average gradients.

    Over every rank.
    """
    return {"world": world // 2}


# graded: 05_input_pipeline Prefetcher
async def fetch(x): return x + 1


def kept(a, b):
    """Not marked: stays as it is."""
    return Buckets(a) if b else average(a)
'''


def test_stubs_keep_signature_and_docstring_and_leave_the_rest_byte_for_byte(tmp_path):
    root = course_copy(tmp_path / "course")
    (root / "course_lib" / "toy.py").write_text(TOY)
    assert {k: v for k, v in graded_references(root).items() if k.startswith("toy.")} == {
        "toy.Buckets": ("07_ddp_reducer", "BucketedDDP"), "toy.average": ("06_ddp", "average_gradients"),
        "toy.fetch": ("05_input_pipeline", "Prefetcher")}
    stubbed = edition.stub_module(root / "course_lib" / "toy.py", root)
    assert "def average(model,\n            world: int = 2,\n            *, op: str = \"sum\") -> dict[str, int]:\n" \
           "    \"\"\"Average gradients.\n\n    Over every rank.\n    \"\"\"\n    raise NotImplementedError(" in stubbed
    assert "class Buckets(dict):\n    \"\"\"Buckets, in reverse order.\"\"\"\n\n" \
           "    def __init__(self, *args, **kwargs):" in stubbed
    assert "@dataclasses.dataclass" not in stubbed and "async def fetch(x):\n    raise NotImplementedError(" in stubbed
    assert "return [self.cap]" not in stubbed and "world // 2" not in stubbed and "x + 1" not in stubbed
    assert stubbed.endswith(TOY[TOY.index("\n\ndef kept"):]) and stubbed.startswith(TOY[:TOY.index("# graded")])
    out = build_student_edition(tmp_path / "edition", root=root)
    results = stub_messages(out, ["toy.Buckets", "toy.average", "toy.fetch"], cwd=tmp_path)
    assert results["toy.fetch"][0] == ("course_lib.toy.fetch is written in notebook 05_input_pipeline's exercise "
                                       "Prefetcher: use the one you wrote there")
    assert all(msg.startswith("course_lib.toy.") for msg, _ in results.values()), results


def test_a_marked_reference_in_a_subfolder_is_stubbed_too(tmp_path):
    """The applications sit in course_lib/apps/: a reference marked there is found, named by its dotted path, and
    stubbed in the edition's copy of that folder."""
    root = course_copy(tmp_path / "course")
    (root / "course_lib" / "apps" / "toy.py").write_text(TOY)
    assert {k for k in graded_references(root) if "toy." in k} == {"apps.toy.Buckets", "apps.toy.average",
                                                                    "apps.toy.fetch"}
    out = build_student_edition(tmp_path / "edition", root=root)
    assert "x + 1" not in (out / "course_lib" / "apps" / "toy.py").read_text()
    results = stub_messages(out, ["apps.toy.fetch"], cwd=tmp_path)
    assert results["apps.toy.fetch"][0].startswith("course_lib.apps.toy.fetch is written in notebook 05_input_pipeline")


def test_unmarked_code_is_identical(built):
    """Unmarked modules byte for byte; in a module with references, every other top-level statement and every
    line between definitions as written (checked from each file's own syntax tree, not from the stubber)."""
    refs = graded_references()
    for path in (ROOT / "course_lib").rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        copy = built / rel
        if path.name.endswith("_hidden.py"):  # the hidden tests' checks: only the grader has them
            assert not copy.exists(), f"{rel} (hidden tests) is in the student edition"
            continue
        dotted = ".".join(path.relative_to(ROOT / "course_lib").with_suffix("").parts)  # parallel/ddp.py: parallel.ddp
        marked = {r.rsplit(".", 1)[1] for r in refs if r.rsplit(".", 1)[0] == dotted}
        if path.suffix != ".py" or not marked:
            assert copy.read_bytes() == path.read_bytes(), f"{rel} differs in the student edition"
            continue
        assert without(path.read_text(), marked) == without(copy.read_text(), marked), rel


def without(text: str, names: set[str]) -> str:
    """A module's text less its top-level definitions named ``names`` (decorators included)."""
    lines = text.splitlines(keepends=True)
    for node in sorted(ast.parse(text).body, key=lambda n: -n.lineno):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines[start - 1:node.end_lineno] = [f"<{node.name}>\n"]
    return "".join(lines)


@pytest.mark.parametrize("module, expect", [
    ("LIMIT = 2\n# graded: 07_ddp_reducer BucketedDDP\nLIMIT = 3\n",
     "must sit on the line right above a top-level def or class"),
    ("class C:\n    # graded: 07_ddp_reducer BucketedDDP\n    def m(self):\n        return 1\n",
     "(a method is stubbed with its class"),
    ("LIMIT = 2\n# graded: 07_ddp_reducer BucketedDDP\n\ndef f():\n    return 1\n", "must sit on the line right above"),
    ("LIMIT = 2\n# graded: 99_nowhere BucketedDDP\ndef f():\n    return 1\n",
     "'99_nowhere' is not a folder of solutions/"),
    ("LIMIT = 2\n# graded: 06_ddp NoSuchExercise\ndef f():\n    return 1\n",
     "'NoSuchExercise' is not the grade_id of a solution cell of 06_ddp; use one of ['rank_batches'"),
    ("LIMIT = 2\n# graded: 06_ddp\ndef f():\n    return 1\n",
     "write exactly '# graded: <assignment> <exercise grade_id>'"),
], ids=["above-a-statement", "above-a-method", "blank-line-between", "no-such-assignment", "no-such-exercise",
        "malformed"])
def test_a_misplaced_or_wrong_marker_is_an_error_that_says_where_and_what_to_fix(tmp_path, module, expect):
    root = course_copy(tmp_path / "course")
    text = '"""Toy."""\n\n' + module
    (root / "course_lib" / "toy.py").write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "graded" in ln)
    for call in (lambda: graded_references(root), lambda: build_student_edition(tmp_path / "out", root=root)):
        with pytest.raises(MarkerError, match=re.escape(f"course_lib/toy.py:{line}")) as err:
            call()
        assert expect in str(err.value)
    assert not (tmp_path / "out").exists(), "a wrong marker must stop the build before anything is written"


# ---------------------------------------------------------------- what the edition holds, and where it goes

def test_the_edition_holds_what_a_student_needs_and_nothing_of_the_instructor(built):
    assert {p.name for p in built.iterdir()} == TOP
    names = files_of(built)
    assert not [n for n in names if re.match(r"(solutions|tests|runs|\.ci|\.git|release|autograded|submitted)/", n)]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")], names
    assert "nbgrader_config.py" not in names and "gradebook.db" not in names
    hidden = {p.relative_to(ROOT).as_posix() for p in (ROOT / "course_grader").rglob("*_hidden.py")}
    assert len(hidden) == len(assignments()) and not hidden & names, \
        "the hidden tests' checks (one module per notebook) must stay out of the student edition"
    assert {n for n in names if n.startswith("course_grader/")} == \
        {p.relative_to(ROOT).as_posix() for p in (ROOT / "course_grader").rglob("*.py")} - hidden, \
        "the student edition has the grader's visible checks and server, unchanged, and no more"
    submissions = {p.name: p.read_bytes() for p in (ROOT / "tests" / "submissions").rglob("*") if p.is_file()}
    assert not [n for n in names if Path(n).name in submissions], "a known-wrong submission is in the edition"
    contents = {(built / n).read_bytes() for n in names}
    assert not set(submissions.values()) & contents
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert (built / "notebooks" / nb.name).read_bytes() == nb.read_bytes(), nb.name
    assert {n for n in names if n.startswith("course_lib/") and not n.endswith(".py")} == \
        {p.relative_to(ROOT).as_posix() for p in (ROOT / "course_lib").rglob("*")
         if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    readme = (built / "README.md").read_text()
    assert "make setup" in readme and "make lab" in readme and "notebooks/00_orientation.ipynb" in readme
    assert all(f"course_lib.{r}" in readme for r in graded_references()), "the README lists every stubbed exercise"


def test_the_student_makefile_sets_up_and_opens_the_lab(built, tmp_path):
    dry = run(["make", "-n", "setup", "lab", "preflight", "ops"], cwd=built)
    assert dry.returncode == 0, dry.stderr
    assert 'pip install -q -c .venv/constraints.txt -e ".[test]"' in dry.stdout
    assert "jupyter lab notebooks/" in dry.stdout
    assert "-m course_lib.apps.preflight" in dry.stdout and "build_deepspeed_ops" in dry.stdout
    stubbed = set(graded_references())  # what setup and preflight run must not be a stub
    assert "parallel.zero_deepspeed.build_deepspeed_ops" not in stubbed
    assert not [r for r in stubbed if r.startswith("preflight.")]
    for target in ("test", "course", "release", "grade"):  # they need tests/ or solutions/: not in the edition
        assert run(["make", "-n", target], cwd=built).returncode != 0, target
    instructor = (ROOT / "Makefile").read_text().split("\n\n")
    for para in (built / "Makefile").read_text().split("\n\n")[2:]:  # after its own help text and .PHONY
        assert para.strip("\n") in [p.strip("\n") for p in instructor], f"not the instructor's rule:\n{para}"
    src = shutil.copytree(built, tmp_path / "src")  # pip writes build/ and egg-info into the source folder
    out = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
               "-w", str(tmp_path / "w")], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = zipfile.ZipFile(next((tmp_path / "w").glob("*.whl")))
    packaged = {n for n in wheel.namelist() if n.startswith(("course_lib/", "course_grader/"))}
    assert packaged == {n for n in files_of(built) if n.startswith(("course_lib/", "course_grader/"))}, \
        "pip install packages the stubbed course_lib and the grader without its hidden checks"
    assert all(wheel.read(n) == (built / n).read_bytes() for n in packaged)


def test_the_archive_holds_the_same_files(built):
    with tarfile.open(built.with_name(built.name + ".tar.gz")) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert {n.removeprefix(built.name + "/") for n in members} == files_of(built)
    assert all(members[f"{built.name}/{n}"] == (built / n).read_bytes() for n in files_of(built))


def test_a_foreign_folder_is_refused_and_kept_and_a_previous_edition_is_replaced(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("a user's work")
    out = run([sys.executable, "-m", "course_grader.edition", "student", str(mine)], cwd=ROOT)
    assert out.returncode == 2 and "is not a student edition" in out.stderr, out.stderr
    assert files_of(mine) == {"thesis.txt"} and (mine / "thesis.txt").read_text() == "a user's work"
    dest = build_student_edition(tmp_path / "ed", archive=True)
    (dest / "README.md").write_text("stale")  # an edited edition may hold someone's work: refused too
    with pytest.raises(FileExistsError, match="README.md"):
        build_student_edition(dest)
    assert (dest / "README.md").read_text() == "stale"
    (dest / "README.md").unlink()  # a file removed from an edition is nobody's work: it is rebuilt
    build_student_edition(dest, archive=True)
    assert (dest / "README.md").read_text() != "stale" and (dest / MARKER_FILE).is_file()
    (tmp_path / "other.tar.gz").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="other.tar.gz"):
        build_student_edition(tmp_path / "other", archive=True)
    assert (tmp_path / "other.tar.gz").read_bytes() == b"not ours" and not (tmp_path / "other").exists()
    assert not list(tmp_path.glob(".*")), "no temporary folder left behind"


# ---------------------------------------------------------------- the grading kernel's course_lib

def test_for_grading_builds_once_per_content_of_course_lib_and_the_grader(tmp_path, monkeypatch):
    root = course_copy(tmp_path / "course")
    monkeypatch.setenv("COURSE_STUDENT_EDITION_DIR", str(tmp_path / "cache"))
    first = for_grading(root)
    assert {p.name for p in first.iterdir()} == {"course_lib", "course_grader", ".content-hash"}
    stamp = (first / ".content-hash").stat().st_mtime_ns
    assert for_grading(root) == first and (first / ".content-hash").stat().st_mtime_ns == stamp, \
        "rebuilt with no change"
    with open(root / "course_lib" / "results.py", "a") as f:
        f.write("\nCHANGED = True\n")
    second = for_grading(root)
    assert second != first and "CHANGED = True" in (second / "course_lib" / "results.py").read_text()
    assert first.is_dir(), "the previous build stays for a grader still using it"
    out = run([sys.executable, "-c", "import course_lib.results as r; print(r.CHANGED, r.__file__)"], cwd=tmp_path,
              env={**os.environ, "PYTHONPATH": str(second)})
    assert out.returncode == 0 and out.stdout.split()[0] == "True", out.stderr[-2000:]
    assert Path(out.stdout.split()[1]).is_relative_to(second)
    with open(root / "course_grader" / "checks" / "nb00.py", "a") as f:  # the grader's content counts too
        f.write("\nGRADER_CHANGED = True\n")
    third = for_grading(root)
    assert third not in (first, second) and "GRADER_CHANGED" in (third / "course_grader/checks/nb00.py").read_text()
    assert not list(third.rglob("*_hidden.py")), "a hidden check in the grading process's edition"


def test_for_grading_from_several_graders_at_once_gives_one_whole_build(tmp_path, monkeypatch):
    root = course_copy(tmp_path / "course")
    monkeypatch.setenv("COURSE_STUDENT_EDITION_DIR", str(tmp_path / "cache"))
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(for_grading(root))) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(got) == 4 and len(set(got)) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [got[0].name], "a half build or a leftover"
    assert files_of(got[0] / "course_lib") == files_of(build_student_edition(tmp_path / "ed", root=root) / "course_lib")


def test_for_grading_cache_is_in_the_venv_or_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_STUDENT_EDITION_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert edition.grading_cache(tmp_path) == tmp_path / "xdg" / "scaling-pytorch-course" / "student_edition"
    (tmp_path / ".venv").mkdir()
    assert edition.grading_cache(tmp_path) == tmp_path / ".venv" / "student_edition"
    monkeypatch.setenv("COURSE_STUDENT_EDITION_DIR", str(tmp_path / "elsewhere"))
    assert edition.grading_cache(tmp_path) == tmp_path / "elsewhere"
