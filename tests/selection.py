"""The gate's selection: the tests a change can break, from what each test reaches.

    python tests/selection.py                 # the base, the changed files, the notebooks and test modules reached
    python tests/selection.py --base REV      # against another base

``make test`` (the gate, what CI runs) passes ``--gate`` to pytest: ``tests/conftest.py`` then keeps only the items
this module selects. ``make test-full`` runs everything; on a fresh clone that passes, ``.ci/run`` prints the commit to
record in ``.ci/full-pass``, the gate's base. The change is every file that differs between the base and the working
tree (committed or not), so a chain of small commits never skips what their sum reaches.

What a test reaches, as files:
- its module and, through every ``import`` (course_lib's, the tests' helper modules), the modules they import, each
  package's ``__init__`` on the way; a launch target written as a string (``"course_lib.parallel.ddp_torch:train"``)
  or a dotted ``"course_lib.x.y"`` is an import too;
- the repository files it names by path (``"docker/start-lab.sh"``), and the files ``READS`` lists for modules that
  read files by glob (a file read is reached, not what it imports); ``LOADS``, modules imported by a computed name;
- the notebooks it names (``"09_deepspeed_zero"``, in its code or in a test's parameters): a notebook reaches its
  solutions and release files, what its code cells import and launch, its checks (``nbNN.py``, ``nbNN_hidden.py``) and
  its known submissions and attacks. A test whose parameters name a notebook, or whose name begins with one's
  number (``test_13_...``), reaches that notebook only, and of what its module loads by a computed name only what
  that notebook reaches.
A change to a file of ``GLOBAL`` (the build, the test harness, the grader's core) selects everything.

What this graph cannot see (a module imported by a name computed at run time, a file opened by a path built from
pieces, a subprocess that runs a tool by name) is caught by the whole suite: ``make test-full`` runs before a base
is recorded, so the gate never trusts a base that a full run did not pass. pytest-testmon selects by coverage, which
misses what runs in a notebook's kernel, a rank process or nbgrader's own processes: most of what this suite runs.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_FILE = ROOT / ".ci" / "full-pass"
# A change to one of these can move any test: the build and its pins, the test harness, the grader's core (what
# every grading and the student's Validate run through) and the cell limits.
GLOBAL = ("pyproject.toml", "Makefile", "environment.yml", ".ci/run", "nbgrader_config.py", "tests/conftest.py",
          "tests/selection.py", "tests/nbgrading.py", "course_grader/checks/__init__.py", "course_grader/child.py",
          "course_grader/grade.py", "course_grader/grading.py", "course_grader/sandbox.py",
          "course_grader/edition.py", "course_grader/nbgrader_plugins.py", "docker/student-lab/nbgrader_config.py")
# Files a test module reads by glob or by a path it builds (their content is what it depends on), and modules it
# imports by a name it computes (what they import counts too): neither is in its code whole.
READS = {
    "tests/test_architecture.py": ("course_lib/*", "course_grader/*"),
    "tests/test_edition.py": ("course_lib/*", "course_grader/*", "solutions/*", "notebooks/*", "docker/*"),
    "tests/test_stub_or_give.py": ("course_lib/*", "course_grader/*", "solutions/*"),
    "tests/test_release.py": ("solutions/*", "notebooks/*"),
    "tests/test_numbering.py": ("solutions/*", "notebooks/*"),
    "tests/test_docker.py": ("docker/*", ".dockerignore"),
    "tests/test_hub.py": ("docker/*",),
    "tests/test_browser.py": ("docker/*",),
    "tests/test_run_all.py": ("README.md",),
    "tests/test_packaging.py": ("course_lib/*", "course_grader/*"),
    "tests/test_student_path.py": ("docker/student-lab/*",),
}
# The modules that grade the notebooks they name (the others run them): they reach the hidden checks and submissions.
GRADING = ("tests/test_grading.py", "tests/test_instructor_flow.py", "tests/test_checks.py", "tests/test_hub.py",
           "tests/test_sandbox.py")
LOADS = {
    "tests/test_checks.py": ("course_grader/checks/*.py",),  # load_all: every check module this edition has
}
NOTEBOOK = re.compile(r"\b(\d\d_[a-z][a-z0-9_]*)\b")
TARGET = re.compile(r"^(course_(?:lib|grader)(?:\.\w+)+)(?::\w+)?$")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@functools.cache
def tracked() -> frozenset[str]:
    """The repository's files (tracked, and untracked ones git does not ignore)."""
    out = git("ls-files", "--cached", "--others", "--exclude-standard")
    return frozenset(p for p in out.splitlines() if (ROOT / p).is_file())


@functools.cache
def assignments() -> tuple[str, ...]:
    return tuple(sorted(p.parent.name for p in ROOT.glob("solutions/*/*.ipynb") if p.stem == p.parent.name))


def base() -> str | None:
    """The commit of the last whole-suite pass: ``$COURSE_GATE_BASE``, else the first word of ``.ci/full-pass``; None
    when there is none, or this clone lacks it (then everything runs)."""
    words = BASE_FILE.read_text().split() if BASE_FILE.is_file() else []
    rev = os.environ.get("COURSE_GATE_BASE") or (words[0] if words else "")
    ok = rev and subprocess.run(["git", "merge-base", "--is-ancestor", rev, "HEAD"], cwd=ROOT,
                                capture_output=True).returncode == 0
    return git("rev-parse", rev).strip() if ok else None


def changed(rev: str) -> set[str]:
    """Files that differ between ``rev`` and the working tree, and new files git does not ignore."""
    out = git("diff", "--name-only", rev) + git("ls-files", "--others", "--exclude-standard")
    return {line for line in out.splitlines() if line}


# ---------------------------------------------------------------- what a file reaches

@functools.cache
def test_helpers() -> dict[str, str]:
    """The tests' own importable modules by name (``nbgrading`` -> ``tests/nbgrading.py``)."""
    return {Path(p).stem: p for p in tracked() if p.startswith("tests/") and p.count("/") == 1 and p.endswith(".py")}


def module_file(dotted: str) -> list[str]:
    """The files importing ``dotted`` runs: each package's ``__init__`` on the way and the module itself."""
    parts, out = dotted.split("."), []
    for i in range(1, len(parts) + 1):
        stem = "/".join(parts[:i])
        for candidate in (f"{stem}/__init__.py", f"{stem}.py"):
            if candidate in tracked():
                out.append(candidate)
    return out


def _reached(tree: ast.AST, here: str) -> tuple[set[str], set[str], set[str]]:
    """(imported, named, read) files of a parsed module or cell. Imported: course_lib modules, the tests' helpers,
    launch targets (``"module:function"``, or the module after ``"-m"``); what they import counts too. Named: a
    module written as a dotted string, which the code may import by that name, or only compare with some text. Read
    (a test's only): the files it names by path, whose content is all it depends on."""
    imported, named, read = set(), set(), set()
    helpers = test_helpers()
    after_m = {id(seq.elts[i + 1]) for seq in ast.walk(tree) if isinstance(seq, (ast.List, ast.Tuple))
               for i, e in enumerate(seq.elts[:-1]) if isinstance(e, ast.Constant) and e.value == "-m"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.update(module_file(alias.name) or ([helpers[alias.name]] if alias.name in helpers else []))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in helpers:
                imported.add(helpers[node.module])
            imported.update(module_file(node.module))
            for alias in node.names:  # from course_lib import train / from course_lib.parallel import ddp
                imported.update(module_file(f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            target = TARGET.match(text)
            if target:
                launched = ":" in text or id(node) in after_m
                (imported if launched else named).update(module_file(target.group(1)))
            elif here.startswith("tests/") and text in tracked():
                read.add(text)
            elif here.startswith("tests/") and "/" in text:
                folder = text.rstrip("/") + "/"
                read.update(p for p in tracked() if p.startswith(folder))
    imported.discard(here)
    named.discard(here)
    return imported, named - imported, read


def _notebooks_named(tree: ast.AST) -> set[str]:
    names = {m for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             for m in NOTEBOOK.findall(node.value)}
    return names & set(assignments())


def _code(path: str) -> list[str]:
    """The Python sources of a module, or of a notebook's code cells (IPython's magics and shell lines left out)."""
    if path.endswith(".py"):
        return [(ROOT / path).read_text()]
    cells = json.loads((ROOT / path).read_text())["cells"]
    return ["\n".join(ln for ln in "".join(c["source"]).splitlines() if not ln.lstrip().startswith(("%", "!")))
            for c in cells if c["cell_type"] == "code"]


@functools.cache
def direct(path: str) -> tuple[frozenset[str], frozenset[str], frozenset[str], frozenset[str]]:
    """(reached, read, notebooks named, imported) of one module or notebook: reached is what it imports, launches or
    names as a module (``_reached``), imported what it imports or launches only."""
    imported, mentioned, read, named = set(), set(), set(), set()
    if path.endswith((".py", ".ipynb")):
        for source in _code(path):
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            i, m, r = _reached(tree, path)
            imported |= i
            mentioned |= m
            read |= r
            named |= _notebooks_named(tree)
    imported |= {p for p in tracked() for pat in LOADS.get(path, ()) if fnmatch.fnmatch(p, pat)} - {path}
    read |= {p for p in tracked() for pat in READS.get(path, ()) if fnmatch.fnmatch(p, pat)}
    return frozenset(imported | mentioned), frozenset(read), frozenset(named), frozenset(imported)


@functools.cache
def imports(path: str, loads: bool = True, strict: bool = False) -> frozenset[str]:
    """``path`` and every module importing it runs: what it imports, what those import. ``loads=False``: not what
    ``path`` itself imports by a computed name (``LOADS``). ``strict``: not what a module only names as a string."""
    seen, todo = {path}, [path]
    skipped = set() if loads else {p for p in tracked() for pat in LOADS.get(path, ()) if fnmatch.fnmatch(p, pat)}
    while todo:
        here = todo.pop()
        for nxt in direct(here)[3 if strict else 0] - (skipped if here == path else set()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)


@functools.cache
def closure(path: str, loads: bool = True) -> frozenset[str]:
    """Every file ``path`` reaches: what it imports (``imports``) and the files any of them reads (notebooks it names
    not included)."""
    seen = imports(path, loads)
    # a test module imported for a helper reads what its own tests read, not what the importer does
    return seen.union(*(direct(p)[1] for p in seen if p == path or not Path(p).name.startswith("test_")))


def _own_files(name: str, graded: bool) -> list[str]:
    """A notebook's own files: its two editions and visible checks; ``graded``, its hidden checks, its known
    submissions and the attacks too."""
    own = [f"solutions/{name}/{name}.ipynb", f"notebooks/{name}.ipynb", f"course_grader/checks/nb{name[:2]}.py"]
    own += [f"course_grader/checks/nb{name[:2]}_hidden.py", f"tests/submissions/{name}.py",
            "tests/submissions/attacks.py"] if graded else []
    return [p for p in own if p in tracked()]


@functools.cache
def notebook_files(name: str, graded: bool = True) -> frozenset[str]:
    """Every file notebook ``name`` reaches when it runs (its two editions, its visible checks, what they import)
    and, ``graded``, when it is graded too (its hidden checks, its known submissions, the attacks)."""
    return frozenset().union(*(closure(p) for p in _own_files(name, graded)))


@functools.cache
def module_reach(test_file: str) -> tuple[frozenset[str], frozenset[str]]:
    """(files, notebooks) a test module reaches: its closure, and the notebooks the module names (its helpers' names
    are theirs: conftest names the notebooks whose gradings start ranks, which a test importing it does not run)."""
    return closure(test_file), direct(test_file)[2]


def own_notebooks(params: str = "", name: str = "") -> set[str]:
    """The notebooks one test item is about: those its parameters name (``[09_deepspeed_zero]``), or the one its
    function's name begins with (``test_13_runs_8_stages_and_tp_8``)."""
    own = set(NOTEBOOK.findall(params)) & set(assignments())
    number = re.match(r"test_(\d\d)_", name)
    return own or {n for n in assignments() if number and n.startswith(number.group(1) + "_")}


def reaches(test_file: str, params: str = "", name: str = "") -> frozenset[str]:
    """The files a test reaches: its module's, and the notebooks it names, as they run, or also as they are graded
    where the module grades them. An item about its own notebooks (``own_notebooks``) reaches those only, and of the
    modules its module loads by a computed name (every notebook's checks, say) only what those notebooks reach."""
    files, named = module_reach(test_file)
    own = own_notebooks(params, name)
    if own:
        files = closure(test_file, loads=False)
    return files.union(*(notebook_files(n, test_file in GRADING) for n in (own or named)))


# The modules that start DeepSpeed's engine or load its CPU ops (comm, CPU Adam): code that runs one of them needs
# the ops compiled first, or it compiles them inside a timed cell or a graded one (about two minutes on 2 cores).
DEEPSPEED = frozenset({"course_lib/parallel/zero_deepspeed.py", "course_lib/parallel/offload.py",
                       "course_lib/apps/size_sweep.py", "course_lib/apps/preflight.py"})


# Modules that name notebooks only to check their text or files, never running one of them.
TEXT_ONLY = ("tests/test_edition.py", "tests/test_stub_or_give.py", "tests/test_selection.py", "tests/test_docker.py",
             "tests/test_numbering.py", "tests/test_release.py")


def runs(test_file: str, params: str = "", name: str = "") -> frozenset[str]:
    """The modules a test's code can run (not the files it only reads): what its module imports and what the
    notebooks it is about import, as ``reaches`` chooses them (none for a module of ``TEXT_ONLY``)."""
    own = own_notebooks(params, name)
    notebooks = () if test_file in TEXT_ONLY else own or direct(test_file)[2]
    return imports(test_file, loads=not own, strict=True).union(
        *(imports(p, strict=True) for n in notebooks for p in _own_files(n, test_file in GRADING)))


def needs_deepspeed_ops(test_file: str, params: str = "", name: str = "") -> bool:
    """Whether a test's code can start DeepSpeed (``DEEPSPEED``): then its ops must be built before it runs."""
    return bool(runs(test_file, params, name) & DEEPSPEED)


# ---------------------------------------------------------------- the selection

class Selection:
    """What a change selects: everything (a global file changed, or no base), or the tests that reach a changed file.

    ``notebook_changed(name)`` says whether a notebook's own files changed (its gradings then run every known case;
    else, selected by a global change, they run a sample)."""

    def __init__(self, rev: str | None, files: set[str] | None = None):
        self.base = rev
        self.files = files if files is not None else (changed(rev) if rev else set())
        self.everything = rev is None or bool(self.files & set(GLOBAL))

    def keeps(self, test_file: str, params: str = "", name: str = "") -> bool:
        return self.everything or bool(self.files & reaches(test_file, params, name))

    def notebook_changed(self, name: str) -> bool:
        return self.base is None or bool(self.files & notebook_files(name, graded=True))

    def describe(self) -> str:
        if self.base is None:
            return "gate: no recorded whole-suite pass that this clone has (.ci/full-pass): everything runs"
        where = "COURSE_GATE_BASE" if os.environ.get("COURSE_GATE_BASE") else ".ci/full-pass"
        head = f"gate: against {self.base[:12]} ({where}), {len(self.files)} changed file(s)"
        if self.everything:
            return head + f"; a global file changed ({sorted(self.files & set(GLOBAL))}): everything runs"
        nbs = [n for n in assignments() if self.files & notebook_files(n)]
        return head + f"; notebooks reached: {' '.join(n[:2] for n in nbs) or 'none'}"


# The floor's version-sensitive tests (.ci/floor): the gate runs the floor when the change reaches one of them.
FLOOR_TESTS = ("tests/test_pp.py", "tests/test_tp.py", "tests/test_fsdp.py", "tests/test_attention.py",
               "tests/test_ddp.py", "tests/test_cp.py", "tests/test_profiling.py")


def floor(sel: Selection) -> tuple[list[str], list[str]]:
    """What the floor runs for this selection: (its tests, the notebooks of its student's path). Nothing when the
    change reaches none of the version-sensitive tests; else those, and the notebooks whose run the change reaches."""
    tests = [t for t in FLOOR_TESTS if sel.keeps(t)]
    if not tests:
        return [], []
    if sel.everything:
        return list(FLOOR_TESTS), list(assignments())
    return tests, [n for n in assignments() if sel.files & notebook_files(n, graded=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/selection.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the commit to diff against (default: .ci/full-pass)")
    parser.add_argument("--floor", action="store_true",
                        help="print what the floor runs: a line of its tests, a line of its notebooks (empty: none)")
    parser.add_argument("--all", action="store_true", help="select everything (the whole suite's choice)")
    args = parser.parse_args(argv)
    sel = Selection(None if args.all else args.base or base())
    if args.floor:
        tests, notebooks = floor(sel)
        print(" ".join(tests))
        print(" ".join(n[:2] for n in notebooks))
        return 0
    print(sel.describe())
    for f in sorted(sel.files):
        print(f"  changed: {f}")
    modules = sorted(p for p in tracked() if re.fullmatch(r"tests/test_\w+\.py", p))
    kept = [m for m in modules if sel.keeps(m)]
    print(f"test modules selected whole: {len(kept)} of {len(modules)}" + "".join(f"\n  {m}" for m in kept))
    if not sel.everything:
        nbs = [n for n in assignments() if sel.files & notebook_files(n)]
        print(f"and the tests of the others whose parameters name a notebook reached: {' '.join(nbs) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
