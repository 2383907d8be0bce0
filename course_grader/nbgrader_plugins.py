"""nbgrader's plugins for this course, which ``nbgrader_config.py`` selects (``autograde_preprocessors``,
``sanitize_preprocessors``). Importing this module loads nbgrader and the standard library, never torch: every nbgrader
command reads the configuration, and only autograde's ``GradeByChecks`` imports the grading server.

- ``SandboxedKernelManager`` / ``SandboxedExecute``: autograde runs each submission's cells in a kernel fenced by
  ``course_grader.sandbox`` (Landlock), so a solution cell cannot read solutions/, the hidden checks, the instructor's
  course_lib or the gradebook. ``COURSE_GRADE_UNSANDBOXED=1`` grades without the fence (practice only).
- ``GradeByChecks``: each test cell that calls ``check(...)`` is scored from ``course_grader.grade``'s verdict,
  computed outside the student's process.
- ``CourseOverwriteCells``: a hidden test cell restored without a warning when it arrives as the release made it.
"""

from __future__ import annotations

import os
import shutil

from jupyter_client.manager import AsyncKernelManager
from nbformat.v4 import new_code_cell, new_output
from nbgrader import utils
from nbgrader.api import MissingEntry
from nbgrader.converters.autograde import Autograde
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor, OverwriteCells
from traitlets import Integer

from course_grader import edition, sandbox

# The student's lab's cell limits, which nbgrader_config.py loads so that autograde grades with them.
STUDENT_LAB_CONFIG = str(edition.ROOT / "docker" / "student-lab" / "nbgrader_config.py")


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started through course_grader.sandbox (Landlock: it reads the Python installation, the system folders,
    the student edition and its own submission; it writes its own scratch folder, removed when the kernel is)."""

    scratch = None
    shm_before = None  # /dev/shm's names before the kernel started, where the kernel cannot have one of its own

    async def _async_pre_start_kernel(self, **kw):
        sandbox.refuse_root()
        if self.shm_before is None and not sandbox.shm_can_be_private():
            self.shm_before = set(os.listdir("/dev/shm"))
        if sandbox.landlock_abi() == 0:
            sandbox.restrict([], [])  # raises the clear error, or warns under COURSE_GRADE_UNSANDBOXED=1
        self.scratch = self.scratch or sandbox.scratch_folder()
        kw["cwd"] = kw.get("cwd") or self.scratch  # never nbgrader's own folder (the course root) by default
        submission = os.path.realpath(kw["cwd"])
        edition_path = str(edition.for_grading())
        kw["env"] = sandbox.grading_env(dict(kw.get("env") or os.environ), self.scratch, edition_path)
        cmd, kw = await super()._async_pre_start_kernel(**kw)
        read, write = sandbox.allow_lists([submission], self.scratch, [self.connection_file], edition.grading_cache(),
                                          edition_path, [str(p) for p in edition.packages()])
        return sandbox.fenced(cmd, read, write), kw

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if not restart and self.shm_before is not None:  # what the kernel left in the machine's shared memory
            sandbox.clear_shm(self.shm_before)
            self.shm_before = None


class SandboxedExecute(Execute):
    """nbgrader's Execute with the sandboxed kernel (Execute's constructor picks the kernel manager itself,
    over any c.Execute.kernel_manager_class, so the class is chosen here)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)


# ---------------------------------------------------------------- scores come from the grader, not the kernel
# A test cell that calls check("grade_id", globals()) is scored here: course_grader.grade runs the submission's
# setup and solution cells in a fenced child process, takes back its probes' data and judges it in this process.
# The verdict replaces what the kernel printed in that cell (an error output if it failed, the judge's message if
# it passed), and nbgrader's SaveAutoGrades then scores the cell from it. Nothing the kernel did (patched helpers,
# a rebound forbid, an AST transformer that swallows errors) reaches these cells' scores.
class GradeByChecks(NbGraderPreprocessor):
    """Write each checked test cell's verdict, computed outside the student's process, as that cell's output."""

    seconds = Integer(60, help="a cell's time limit in the grading process (nbgrader_config sets Execute's)"
                      ).tag(config=True)

    def preprocess(self, nb, resources):
        from course_grader import grade  # torch: only in the autograde process, not every nbgrader command

        verdicts = grade.grade(nb, seconds=self.seconds)
        reports = flags = next((v.reports for v in verdicts.values() if v.reports), ())
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            verdict = verdicts.get(meta.get("grade_id")) if meta.get("grade") else None
            if verdict is None:
                continue
            cell.outputs = [new_output("stream", name="stdout", text=verdict.message + "\n")] if verdict.passed else \
                [new_output("error", ename="AssertionError", evalue=verdict.message,
                            traceback=[f"AssertionError (scored by the grader): {verdict.message}"])]
            if reports:  # what the grading process's audit hook saw: shown on the first graded cell, to both
                cell.outputs.insert(0, new_output("stream", name="stderr", text=flagged(reports)))
                reports = ()
        if flags:
            nb.metadata["course_grading_reports"] = list(flags)
            self.log.warning("FLAGGED %s: %s", resources.get("unique_key", "this submission"),
                             "; ".join(nb.metadata["course_grading_reports"]))
        return nb, resources


def flagged(reports) -> str:
    """What the grading process reported of a submission, as the instructor reads it in Formgrader."""
    return ("FLAGGED by the grader for the instructor to review (course_grader.audit):\n"
            + "".join(f"  - {r}\n" for r in reports))


# ---------------------------------------------------------------- a restored test cell is reported only if edited
# nbgrader restores every locked cell from the source and warns "Attribute 'checksum' for cell ... has changed!" where
# the submitted one differs. A hidden test cell always differs: the release removed its hidden region. So every
# student's every hidden test cell was reported, and an instructor could not tell a student's edit from the release.
class CourseOverwriteCells(OverwriteCells):
    """nbgrader's OverwriteCells; a hidden test cell that arrives exactly as the release made it is restored without a
    warning, so the warnings that remain name test cells a student edited."""

    def preprocess_cell(self, cell, resources, cell_index):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is not None and utils.is_locked(cell):
            try:
                source = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id).source
            except MissingEntry:
                source = None
            if source is not None and cell.source != source and cell.source == released(source):
                cell.source = source
        return super().preprocess_cell(cell, resources, cell_index)


def released(source: str) -> str:
    """A test cell's source as the release gives it to students: its hidden-test region removed (nbgrader's own
    rule)."""
    cell = new_code_cell(source)
    ClearHiddenTests()._remove_hidden_test_region(cell)
    return cell.source


def autograde_preprocessors() -> list:
    """nbgrader's autograde steps, with the sandboxed kernel and the grader's checks right after it."""
    out = []
    for p in Autograde.autograde_preprocessors.default():
        out += [SandboxedExecute, GradeByChecks] if p is Execute else [p]
    return out


def sanitize_preprocessors() -> list:
    """nbgrader's sanitize steps, with the cell restore that reports only edited test cells."""
    return [CourseOverwriteCells if p is OverwriteCells else p for p in Autograde.sanitize_preprocessors.default()]
