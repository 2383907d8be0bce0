"""The student edition of the course: what a student receives, made from this repository by one command.

    python -m course_grader.edition student DEST [--archive]   # or: python3 course_grader/edition.py student DEST
    python -m course_grader.edition grading                     # print the folder for_grading() returns

The repository is the instructor's edition. The student edition holds the release notebooks, a
``course_lib`` in which every graded reference is a stub, and what a student needs to set up and
run (pyproject.toml, environment.yml, a Makefile with setup/lab/ops/preflight, docker/start-lab.sh):
no solutions/, no tests/, no known-wrong submissions, no instructor runs.

A graded reference is a top-level ``def`` or ``class`` of ``course_lib/*.py`` with, on the line
right above it (above any decorator), a comment ``# graded: <assignment> <exercise grade_id>``.
Its stub keeps the name, the signature (a class: its bases) and the docstring, and raises
``NotImplementedError`` naming the notebook and exercise where the student writes it.

``for_grading()`` gives the grading kernel the same stubbed ``course_lib`` to put first on
PYTHONPATH, so a submission imports the student edition, never the instructor's references.

Standard library only: it runs before any environment exists (``make student-edition``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # course_grader/ -> the repository
MARKER_FILE = ".student-edition.json"  # in every student edition: a later build may replace that folder
MARKER = re.compile(r"# graded: (\S+) (\S+)")
LOOKS_LIKE_MARKER = re.compile(r"#\s*graded\s*:")
STUB_MESSAGE = ("course_lib.{module}.{name} is written in notebook {assignment}'s exercise {exercise}: "
                "use the one you wrote there")
# What a student gets besides notebooks/, course_lib/ and course_grader/ (copied as they are).
STUDENT_FILES = ("pyproject.toml", "environment.yml", "docker/start-lab.sh", "docker/student-lab", ".gitignore")
# The instructor Makefile's targets a student uses; their rules are copied unchanged (student_makefile).
STUDENT_TARGETS = ("$(VENV)/.installed", "$(SHM_OP)", "$(CPU_ADAM_OP)", "setup", "ops", "lab", "preflight")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
# course_grader/checks/nbNN_hidden.py: the hidden tests' checks, which only the grader runs
HIDDEN = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*_hidden.py")
DEF = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class MarkerError(ValueError):
    """A ``# graded:`` marker that the student edition cannot apply; the message says file:line and the fix."""


# ---------------------------------------------------------------- markers

def _solution_ids(root: Path, assignment: str) -> list[str] | None:
    """grade_ids of the solution cells of solutions/<assignment>/<assignment>.ipynb (None: no such notebook)."""
    nb_path = root / "solutions" / assignment / f"{assignment}.ipynb"
    if not nb_path.is_file():
        return None
    cells = json.loads(nb_path.read_text())["cells"]
    meta = [c.get("metadata", {}).get("nbgrader", {}) for c in cells]
    return [m["grade_id"] for m in meta if m.get("solution") and "grade_id" in m]


def _markers(path: Path) -> list[tuple[int, int, str]]:
    """(line, column, text) of every comment of a module that looks like a graded marker."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.start[1], t.string.strip()) for t in tokens
            if t.type == tokenize.COMMENT and LOOKS_LIKE_MARKER.match(t.string)]


def _top_level_starts(tree: ast.Module) -> dict[int, ast.AST]:
    """First line (its first decorator's, if any) of every top-level def and class."""
    return {min([n.lineno] + [d.lineno for d in n.decorator_list]): n for n in tree.body if isinstance(n, DEF)}


def _marked(root: Path, path: Path) -> tuple[list[tuple[ast.AST, str, str]], list[str]]:
    """The marked definitions of one module, as (node, assignment, exercise), and the errors found."""
    rel = path.relative_to(root)
    starts = _top_level_starts(ast.parse(path.read_text(), str(path)))
    found, errors = [], []
    for line, col, text in _markers(path):
        where = f"{rel}:{line}"
        m = MARKER.fullmatch(text)
        if not m:
            errors.append(f"{where}: {text!r} is not a marker: "
                          "write exactly '# graded: <assignment> <exercise grade_id>'")
            continue
        assignment, exercise = m.groups()
        node = starts.get(line + 1)
        if col != 0 or node is None:
            errors.append(f"{where}: '{text}' must sit on the line right above a top-level def or class (above its "
                          "decorators); move it there (a method is stubbed with its class: mark the class)")
            continue
        ids = _solution_ids(root, assignment)
        if ids is None:
            known = sorted(p.name for p in (root / "solutions").iterdir() if p.is_dir())
            errors.append(f"{where}: assignment {assignment!r} is not a folder of solutions/ with its notebook; "
                          f"use one of {known}")
        elif exercise not in ids:
            errors.append(f"{where}: {exercise!r} is not the grade_id of a solution cell of {assignment}; "
                          f"use one of {ids}")
        else:
            found.append((node, assignment, exercise))
    return found, errors


def _modules(root: Path) -> list[Path]:
    """The library's and the applications' modules, in every folder of course_lib/ (the grader, course_grader/,
    holds no graded reference: its hidden checks are left out whole)."""
    return sorted((root / "course_lib").rglob("*.py"))


def _dotted(path: Path, root: Path) -> str:
    """``course_lib/apps/run_all.py`` -> ``apps.run_all``: the module's name below ``course_lib``."""
    return ".".join(path.relative_to(root / "course_lib").with_suffix("").parts)


def graded_references(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """``{"module.Name": (assignment, exercise)}`` of every marked definition of ``course_lib/*.py``.

    Raises ``MarkerError`` listing every misplaced or wrong marker (file:line and what to change).
    """
    refs, errors = {}, []
    for path in _modules(root):
        found, errs = _marked(root, path)
        errors += errs
        refs.update({f"{_dotted(path, root)}.{node.name}": (a, e) for node, a, e in found})
    if errors:
        raise MarkerError("graded markers the student edition cannot apply:\n  " + "\n  ".join(errors))
    return refs


# ---------------------------------------------------------------- stubs

def _header(lines: list[str], node: ast.AST) -> str:
    """The source text of a definition's header, from ``def``/``class`` to its colon (multi-line headers too)."""
    snippet = "".join(lines[node.lineno - 1:node.end_lineno])
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(snippet).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
            row, col = tok.end
            head = snippet.splitlines(keepends=True)[:row]
            return "".join(head[:-1]) + head[-1][:col]
    raise AssertionError(f"no header colon in {node.name}")  # unreachable for code that parses


def _docstring(lines: list[str], source: str, node: ast.AST, header_end: int) -> str:
    """The definition's docstring as written (indented lines ending in a newline), or ''."""
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return ""
    if first.lineno > header_end:  # the usual case: the docstring starts its own line, kept byte for byte
        return "".join(lines[first.lineno - 1:first.end_lineno]).rstrip("\n") + "\n"
    return "    " + ast.get_source_segment(source, first) + "\n"


def stub_source(lines: list[str], source: str, node: ast.AST, message: str) -> str:
    """The stub that replaces one definition: same header and docstring, raising ``NotImplementedError(message)``."""
    header = _header(lines, node)
    doc = _docstring(lines, source, node, node.lineno + header.count("\n"))
    if isinstance(node, ast.ClassDef):  # a class: construct it and you learn where it is written
        return (f"{header}\n{doc}\n    def __init__(self, *args, **kwargs):\n"
                f"        raise NotImplementedError({message!r})\n")
    return f"{header}\n{doc}    raise NotImplementedError({message!r})\n"


def stub_module(path: Path, root: Path = ROOT) -> str:
    """The student edition's text of one module: every marked definition stubbed, every other line unchanged.

    Raises ``MarkerError`` for a wrong marker, and ``SyntaxError`` if the stubbed module does not compile.
    """
    found, errors = _marked(root, path)
    if errors:
        raise MarkerError("graded markers the student edition cannot apply:\n  " + "\n  ".join(errors))
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    for node, assignment, exercise in sorted(found, key=lambda f: -f[0].lineno):  # bottom up: line numbers hold
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])  # decorators go with the definition
        message = STUB_MESSAGE.format(module=_dotted(path, root), name=node.name, assignment=assignment,
                                      exercise=exercise)
        lines[start - 1:node.end_lineno] = [stub_source(lines, source, node, message)]
    text = "".join(lines)
    compile(text, f"student edition of {path.relative_to(root)}", "exec")
    return text


def write_course_lib(dest: Path, root: Path = ROOT) -> Path:
    """Copy ``course_lib/`` (its data files too, no caches) to ``dest`` with every graded reference stubbed."""
    shutil.copytree(root / "course_lib", dest, ignore=HIDDEN)
    for path in _modules(root):
        (dest / path.relative_to(root / "course_lib")).write_text(stub_module(path, root))
    return dest


def write_grader(dest: Path, root: Path = ROOT) -> Path:
    """Copy ``course_grader/`` to ``dest`` without the hidden tests' checks: the visible checks a notebook's test
    cells call, and the grading server the grader runs on this edition."""
    shutil.copytree(root / "course_grader", dest, ignore=HIDDEN)
    return dest


# ---------------------------------------------------------------- the student edition

def student_makefile(root: Path = ROOT) -> str:
    """A Makefile for the student edition: the instructor Makefile's variables and its rules for STUDENT_TARGETS.

    The rules are copied, not rewritten, so the student's ``make setup`` keeps an installed torch exactly
    as the instructor's does. The other targets need tests/, solutions/ or .ci/ and are left out.
    """
    kept, defined = [], set()
    for para in (root / "Makefile").read_text().split("\n\n")[1:]:  # [0] is the instructor's help text
        rules = [ln for ln in para.splitlines() if re.match(r"[^\s#][^:=#]*:(?![=:])", ln)]
        targets = {t for ln in rules for t in ln.split(":", 1)[0].split()}
        if para.lstrip().startswith(".PHONY") or not targets <= set(STUDENT_TARGETS):
            continue
        if targets or re.search(r"^\w+\s*[:?+]?=", para, re.M):  # a kept rule, or variables
            kept.append(para.strip("\n"))
            defined |= targets
    missing = set(STUDENT_TARGETS) - defined
    if missing:
        raise ValueError(f"the Makefile has no rule for {sorted(missing)}: the student edition's Makefile needs them")
    head = ("# Scaling PyTorch training, student edition: set up, then open the notebooks.\n"
            "#   make setup      create .venv and install the course (a torch already installed is kept)\n"
            "#   make lab        start JupyterLab on notebooks/\n"
            "#   make ops        (re)build DeepSpeed's CPU ops into TORCH_EXTENSIONS_DIR (setup does it once)\n"
            "#   make preflight  check this machine's GPU paths "
            "(one table; exit 1 when a path the course needs fails)\n"
            "# Written by course_grader/edition.py from the course's Makefile "
            "(its rules for these targets, unchanged).\n")
    return head + "\n.PHONY: setup ops lab preflight\n\n" + "\n\n".join(kept) + "\n"


def _title(nb_path: Path) -> str:
    """A notebook's title: the first heading of its first markdown cell."""
    for cell in json.loads(nb_path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return nb_path.stem


def student_readme(root: Path = ROOT) -> str:
    """The student edition's README: set up, open the notebooks, where the exercises are."""
    notebooks = "\n".join(f"- `notebooks/{p.name}`: {_title(p)}" for p in sorted((root / "notebooks").glob("*.ipynb")))
    stubs = "\n".join(f"- `course_lib.{name}`: notebook {a}, exercise `{e}`"
                      for name, (a, e) in sorted(graded_references(root).items()))
    return f"""# Scaling PyTorch training (student edition)

Notebooks that teach how to train models too big or too slow for one plain GPU loop, on a small
training library, `course_lib`. They run on a laptop CPU, one GPU, or an 8-GPU node.

## Set up and open the notebooks

```bash
make setup    # creates .venv and installs the course (about two minutes); a torch already installed is kept
make lab      # JupyterLab on notebooks/
```

On a GPU machine install PyTorch for your platform first (ROCm or CUDA), then `make setup`, and check
the machine with `make preflight`. With conda instead: `conda env create -f environment.yml`.
`docker/start-lab.sh` serves the same notebooks from a container or a shared machine.

## The notebooks, in order

{notebooks}

## Where the exercises are

Run each notebook top to bottom. Where a cell says `# YOUR CODE HERE`, replace
`raise NotImplementedError()` with your code, then run the visible test cell below it; hidden tests run
when your notebook is graded. The first code cell's `tier = "auto"` picks sizes from your hardware.

What you write in an exercise is yours to write: these parts of `course_lib` raise
`NotImplementedError` and name the exercise where you write them; use your own version from that notebook.

{stubs or "- (none)"}
"""


def _files(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path (the edition's marker lists them)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER_FILE}


def _check_replaceable(dest: Path) -> None:
    """Refuse a ``dest`` that holds anything but an untouched student edition: never delete a user's files."""
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return
    marker = dest / MARKER_FILE
    if not dest.is_dir() or not marker.is_file():
        raise FileExistsError(f"{dest} exists and is not a student edition (no {MARKER_FILE}): "
                              "choose another DEST, or move that folder away yourself")
    recorded, now = json.loads(marker.read_text())["files"], _files(dest)
    foreign = sorted(p for p in now if recorded.get(p) != now[p])
    if foreign:
        raise FileExistsError(f"{dest} is a student edition, but these files are new or changed since it was built: "
                              f"{foreign[:5]}{' ...' if len(foreign) > 5 else ''}; "
                              "move them (or the folder) away, then run again")


def _write_edition(out: Path, root: Path) -> None:
    """Write every file of the student edition into the empty folder ``out``."""
    shutil.copytree(root / "notebooks", out / "notebooks", ignore=IGNORED)
    write_course_lib(out / "course_lib", root)
    write_grader(out / "course_grader", root)
    for rel in STUDENT_FILES:
        if (root / rel).is_dir():
            shutil.copytree(root / rel, out / rel, ignore=IGNORED)
        elif (root / rel).exists():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, out / rel)
    (out / "Makefile").write_text(student_makefile(root))
    (out / "README.md").write_text(student_readme(root))
    marker = {"edition": "student", "course_lib": content_hash(*packages(root)), "files": _files(out)}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")


def build_student_edition(dest: Path | str, root: Path = ROOT, archive: bool = False) -> Path:
    """Write the student edition to ``dest`` (and ``dest``.tar.gz with ``archive``); return ``dest``.

    ``dest`` must be absent, empty, or a student edition written before and left untouched (then it is
    replaced). The edition is built beside it and renamed into place, so a failed build leaves nothing half-done.
    """
    dest, root = Path(dest).resolve(), Path(root).resolve()
    _check_replaceable(dest)
    if archive:
        _check_archive_replaceable(dest.with_name(dest.name + ".tar.gz"))
    graded_references(root)  # every marker valid before anything is written
    dest.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    out.chmod(0o755)  # mkdtemp's 0700 would keep the edition from the image's student user
    try:
        _write_edition(out, root)
        if dest.exists():
            old = dest.with_name(f".{dest.name}-old-{os.getpid()}")
            dest.rename(old)
            shutil.rmtree(old)
        out.rename(dest)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if archive:
        write_archive(dest)
    return dest


def _check_archive_replaceable(tar_path: Path) -> None:
    """Refuse to overwrite a file at ``tar_path`` unless it is an archive this module wrote (its marker first)."""
    if not tar_path.exists():
        return
    try:
        with tarfile.open(tar_path) as old:
            first = next(iter(old), None)
    except (tarfile.TarError, OSError):
        first = None
    if first is None or first.name != f"{tar_path.name.removesuffix('.tar.gz')}/{MARKER_FILE}":
        raise FileExistsError(f"{tar_path} exists and is not a student edition's archive: move it away, then run again")


def write_archive(edition: Path) -> Path:
    """``<edition>.tar.gz``: the edition's files under one folder of its name, the marker first."""
    tar_path = edition.with_name(edition.name + ".tar.gz")
    _check_archive_replaceable(tar_path)
    tmp = tar_path.with_name(f".{tar_path.name}.{os.getpid()}")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(edition / MARKER_FILE, f"{edition.name}/{MARKER_FILE}")
        for rel in _files(edition):
            tar.add(edition / rel, f"{edition.name}/{rel}")
    tmp.replace(tar_path)
    return tar_path


# ---------------------------------------------------------------- the grading kernel's course_lib

def packages(root: Path = ROOT) -> tuple[Path, Path]:
    """The instructor's two packages: the library and its grader."""
    return root / "course_lib", root / "course_grader"


def content_hash(*folders: Path) -> str:
    """sha256 of the folders' files (names, paths and bytes; caches ignored): changes whenever one of them does."""
    h = hashlib.sha256()
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                rel = Path(folder.name) / p.relative_to(folder)
                h.update(rel.as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def grading_cache(root: Path = ROOT) -> Path:
    """Where for_grading() keeps its builds: $COURSE_STUDENT_EDITION_DIR, else <root>/.venv/student_edition,
    else the user's cache folder."""
    if os.environ.get("COURSE_STUDENT_EDITION_DIR"):
        return Path(os.environ["COURSE_STUDENT_EDITION_DIR"])
    if (root / ".venv").is_dir():
        return root / ".venv" / "student_edition"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "scaling-pytorch-course" / "student_edition"


def for_grading(root: Path = ROOT) -> Path:
    """A folder holding the student edition's ``course_lib`` and ``course_grader`` (only them): put it first on the
    grading kernel's PYTHONPATH.

    One build per content of ``course_lib/`` and ``course_grader/`` (a folder named by its hash): built on first use
    and again whenever either changes. It is built in a temporary folder and renamed into place, so two graders
    starting at once never see half a build.
    """
    root = Path(root).resolve()
    cache = grading_cache(root)
    digest = content_hash(*packages(root))
    final = cache / digest[:16]
    if (final / ".content-hash").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    tmp.chmod(0o755)  # readable by a grading kernel that runs as another user
    try:
        write_course_lib(tmp / "course_lib", root)
        write_grader(tmp / "course_grader", root)
        (tmp / ".content-hash").write_text(digest + "\n")
        tmp.rename(final)
    except OSError:
        if not (final / ".content-hash").is_file():  # not another grader's build winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache, keep=final)
    return final


def _prune(cache: Path, keep: Path, age_s: float = 86400) -> None:
    """Remove builds of older course_libs (and abandoned temporary folders) untouched for a day.

    Not at once: a grader that started on the previous build may still import from it.
    """
    for p in cache.iterdir():
        if p != keep and p.is_dir() and time.time() - p.stat().st_mtime > age_s:
            shutil.rmtree(p, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``student DEST [--archive]`` writes the student edition; ``grading`` prints for_grading()."""
    parser = argparse.ArgumentParser(prog="python -m course_grader.edition", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    student = sub.add_parser("student", help="write the student edition to DEST")
    student.add_argument("dest", type=Path)
    student.add_argument("--archive", action="store_true", help="also write DEST.tar.gz, the downloadable folder")
    sub.add_parser("grading", help="build (if needed) and print the grading kernel's course_lib folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "grading":
            print(for_grading())
            return 0
        dest = build_student_edition(args.dest, archive=args.archive)
    except (MarkerError, FileExistsError) as err:
        print(f"edition: {err}", file=sys.stderr)
        return 2
    refs = graded_references()
    print(f"student edition: {dest} ({len(refs)} graded references stubbed)"
          + (f", {dest}.tar.gz" if args.archive else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
