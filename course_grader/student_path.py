"""The student's path: the student edition run and validated the way a student runs and validates it.

    python -m course_grader.student_path              # every notebook, with a correct student's answers
    python -m course_grader.student_path 09 14        # some notebooks
    python -m course_grader.student_path --blank      # the untouched release: Validate fails at every exercise

A student gets the student edition (``course_lib`` with every graded reference a stub), writes each exercise in
its solution cell, runs the visible tests and presses Validate. This does the same with nobody at the keyboard:
it builds the student edition, writes into each release notebook's solution cells what a correct student writes
(the code of ``solutions/`` without nbgrader's markers) and validates the notebook with nbgrader's own
``Validator``, configured exactly as the lab's Validate button configures it (``docker/student-lab/``, the
student's cell limits, found through ``JUPYTER_CONFIG_PATH``), the edition's ``course_lib`` first on the kernel's
path and the smoke tier (nbgrader picks it while validating).

A notebook passes when Validate says "Success" and no cell of it raised. ``--blank`` validates the release as
it ships, with its demonstrations left out (the cells tagged ``demo``, which no test reads): every visible test of
every exercise must fail, and each failure must name a function or class of its exercise, so that a student who
presses Validate before writing it reads what is missing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from course_grader.edition import MARKER_FILE, build_student_edition
from course_grader.release import assignments

ROOT = Path(__file__).resolve().parents[1]  # course_grader/ -> the repository
STUDENT_LAB = Path("docker") / "student-lab"  # the student's Jupyter configuration, in either edition
MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")


def nbgrader_meta(cell: dict) -> dict:
    """A cell's nbgrader metadata ({} for an ordinary cell)."""
    return cell.get("metadata", {}).get("nbgrader", {})


def answer(source: str) -> str:
    """What a correct student's solution cell holds: the solution's text without nbgrader's marker lines."""
    return "".join(line for line in source.splitlines(keepends=True) if not MARKERS.match(line))


def filled(release: dict, solution: dict) -> dict:
    """The release notebook ``release`` with every solution cell written as ``solution`` writes it; no other cell
    changes (the test cells keep their checksums, as a student's do)."""
    answers = {nbgrader_meta(c)["grade_id"]: "".join(c["source"]) for c in solution["cells"]
               if nbgrader_meta(c).get("solution")}
    out = copy.deepcopy(release)
    for cell in out["cells"]:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            if meta["grade_id"] not in answers:
                raise ValueError(f"solution cell {meta['grade_id']!r} of the release is not in solutions/: "
                                 "regenerate the release (python -m course_grader.release)")
            cell["source"] = answer(answers[meta["grade_id"]])
    return out


def without_demos(nb: dict) -> dict:
    """``nb`` without the cells tagged ``demo`` (demonstrations that no test reads)."""
    out = copy.deepcopy(nb)
    out["cells"] = [c for c in out["cells"] if "demo" not in c.get("metadata", {}).get("tags", [])]
    return out


def exercises(solution: dict) -> dict[str, dict]:
    """Per solution cell of a solutions notebook: the names it defines and the visible tests that follow it
    (``{"ring_attention": {"names": ["merge", ...], "tests": ["test_online_softmax_merge", ...]}}``)."""
    out: dict[str, dict] = {}
    current = None
    for cell in solution["cells"]:
        meta, source = nbgrader_meta(cell), "".join(cell["source"])
        if meta.get("solution") and cell["cell_type"] == "code":
            current = meta["grade_id"]
            tree = ast.parse(answer(source))
            names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            out[current] = {"names": names, "tests": []}
        elif meta.get("grade") and cell["cell_type"] == "code" and current and "BEGIN HIDDEN TESTS" not in source:
            out[current]["tests"].append(meta["grade_id"])
    return out


@contextmanager
def student_process(edition: Path, run_dir: Path) -> Iterator[None]:
    """This process as the student's lab server: in the edition's folder (where ``make lab`` starts it), the
    student-lab configuration on ``JUPYTER_CONFIG_PATH``, the edition's ``course_lib`` first on the kernels' path
    and their results written under ``run_dir``. Everything is restored after."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ["JUPYTER_CONFIG_PATH"] = str(edition / STUDENT_LAB)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(edition), saved_env.get("PYTHONPATH")) if p)
    os.environ["COURSE_RUN_DIR"] = str(run_dir)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.chdir(edition)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def validate(path: Path) -> tuple[dict, dict]:
    """Validate one notebook as the lab's Validate button does: ``(results, executed notebook)``.

    The configuration is loaded by the button's own handler code (nbgrader's ``ValidateAssignmentHandler``), so
    what it finds is what a student's Validate finds. ``results`` is the button's answer: empty means "Success";
    else ``failed`` (or ``changed``) lists the cells with their errors. Call it inside ``student_process``.
    """
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler
    from nbgrader.validator import Validator

    class Keeping(Validator):
        """nbgrader's Validator, keeping the notebook it executed (to find a raised cell that is not graded)."""

        executed = None

        def _preprocess(self, nb):
            self.executed = super()._preprocess(nb)
            return self.executed

    config = ValidateAssignmentHandler.load_config(None)  # the button's configuration, from cwd and the config path
    validator = Keeping(config=config)
    results = validator.validate(str(path))
    return results, validator.executed


def raised(nb: dict) -> list[str]:
    """The cells of an executed notebook that raised, as ``"cell N: Error: message"``."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                out.append(f"cell {i}: {o.get('ename')}: {str(o.get('evalue'))[:300]}")
    return out


def grade_ids(nb: dict, cell_sources: list[str]) -> list[str]:
    """The grade_ids of the test cells whose source is one of ``cell_sources`` (Validate reports cells by source)."""
    wanted = {s.strip() for s in cell_sources}
    return [nbgrader_meta(c)["grade_id"] for c in nb["cells"]
            if nbgrader_meta(c).get("grade") and "".join(c["source"]).strip() in wanted]


def write_answers(name: str, edition: Path, root: Path = ROOT) -> Path:
    """Write a correct student's answers into notebook ``name`` of ``edition`` (as a student saves it); its path."""
    release_path = edition / "notebooks" / f"{name}.ipynb"
    solution = json.loads((root / "solutions" / name / f"{name}.ipynb").read_text())
    release_path.write_text(json.dumps(filled(json.loads(release_path.read_text()), solution), indent=1) + "\n")
    return release_path


def failed_tests(executed: dict) -> dict[str, str]:
    """The test cells of an executed notebook that Validate counts as failed (an error, or anything on stderr:
    nbgrader's own rule), with what they printed."""
    from nbformat import from_dict
    from nbgrader.utils import determine_grade, is_grade

    out = {}
    for cell in from_dict(executed)["cells"]:
        if cell.cell_type == "code" and is_grade(cell):
            score, points = determine_grade(cell)
            if score is not None and score < points:
                shown = [o.get("text") or o.get("evalue") or ""
                         for o in cell.outputs if o.output_type in ("stream", "error")]
                shown = ["".join(s) if isinstance(s, list) else s for s in shown]  # a stream's text may be its lines
                out[cell.metadata.nbgrader.grade_id] = "".join(shown)[-600:]
    return out


def check_filled(name: str, edition: Path, run_dir: Path, root: Path = ROOT) -> list[str]:
    """Validate notebook ``name`` of ``edition`` with a correct student's answers; the problems found ([] = Success)."""
    release_path = write_answers(name, edition, root)
    with student_process(edition, run_dir):
        results, executed = validate(release_path)
    _keep(executed, run_dir, name)
    problems = [f"Validate: {len(results.get(k, []))} cell(s) {k}: " + "; ".join(
        f"{grade_ids(executed, [c['source']]) or c['source'][:60]!r}: {c.get('raw_error', '')[-600:]}"
        for c in results.get(k, [])) for k in ("type_changed", "changed", "failed") if results.get(k)]
    return problems + [f"raised in {r}" for r in raised(executed)]


def check_blank(name: str, edition: Path, run_dir: Path, root: Path = ROOT) -> list[str]:
    """Validate notebook ``name`` of ``edition`` as released (demonstrations left out): the exercises whose visible
    tests pass, or fail without naming what the student has to write ([] = every exercise fails as it should)."""
    release = json.loads((edition / "notebooks" / f"{name}.ipynb").read_text())
    exercises_only = edition / "notebooks" / f"{name}.exercises.ipynb"  # beside the release, which stays as it ships
    exercises_only.write_text(json.dumps(without_demos(release), indent=1) + "\n")
    with student_process(edition, run_dir):
        results, executed = validate(exercises_only)
    _keep(executed, run_dir, f"{name}.blank")
    failed = {gid: c["raw_error"] for c in results.get("failed", []) for gid in grade_ids(executed, [c["source"]])}
    problems = []
    solution = json.loads((root / "solutions" / name / f"{name}.ipynb").read_text())
    for exercise, found in exercises(solution).items():
        for test in found["tests"]:
            if test not in failed:
                problems.append(f"{exercise}: {test} passes on the untouched release")
            elif not any(re.search(rf"\b{re.escape(n)}\b", failed[test]) for n in found["names"]):
                problems.append(f"{exercise}: {test} fails without naming {found['names']}: "
                                f"{failed[test].strip().splitlines()[-1][:300] if failed[test].strip() else '(empty)'}")
    return problems


def _keep(executed: dict | None, run_dir: Path, name: str) -> None:
    """Write the executed notebook to ``run_dir/executed/`` (to read what a failing cell printed)."""
    if executed is not None:
        (run_dir / "executed").mkdir(parents=True, exist_ok=True)
        (run_dir / "executed" / f"{name}.ipynb").write_text(json.dumps(executed, indent=1))


def run(names: list[str], out: Path, blank: bool = False, root: Path = ROOT) -> dict[str, tuple[float, list[str]]]:
    """Build the student edition under ``out`` and check ``names`` on it; ``{name: (seconds, problems)}``."""
    out = Path(out).resolve()
    if (out / "edition" / MARKER_FILE).is_file():  # this command's own edition, its notebooks written last time
        shutil.rmtree(out / "edition")
    edition = build_student_edition(out / "edition", root)
    check = check_blank if blank else check_filled
    found = {}
    for name in names:
        start = time.perf_counter()
        problems = check(name, edition, out / "runs", root)
        found[name] = (time.perf_counter() - start, problems)
        print(f"{name}: {'Success' if not problems else 'FAILED'} ({found[name][0]:.0f} s)", flush=True)
        for p in problems:
            print(f"  {p}", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    """``python -m course_grader.student_path [NN ...] [--blank] [--out DIR]``: exit 1 if a notebook fails."""
    parser = argparse.ArgumentParser(prog="python -m course_grader.student_path",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="notebooks by number or name (default: all)")
    parser.add_argument("--blank", action="store_true", help="validate the untouched release: every exercise must fail")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "student-path",
                        help="where the student edition and the executed notebooks go (default runs/student-path)")
    args = parser.parse_args(argv)
    names = [a for a in assignments() if not args.only or {a[:2], a} & set(args.only)]
    if not names:
        parser.error(f"no notebook matches {args.only}; available: {assignments()}")
    start = time.perf_counter()
    found = run(names, args.out, args.blank)
    bad = [n for n, (_, problems) in found.items() if problems]
    what = "the untouched release failing at every exercise" if args.blank else "Validate"
    print(f"student's path ({what}): {len(names) - len(bad)} of {len(names)} notebooks as a student expects, "
          f"{time.perf_counter() - start:.0f} s" + (f"; failed: {' '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
