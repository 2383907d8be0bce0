"""nbgrader configuration of the course: run nbgrader's commands from the project root.

solutions/<assignment>/<assignment>.ipynb is the source (one notebook per assignment);
``nbgrader generate_assignment`` writes release/, and ``python -m course_lib.apps.release``
copies that into notebooks/ (committed, so a clone opens and runs with no instructor step).
Collected work goes to submitted/<student>/<assignment>/; ``nbgrader autograde``,
``generate_feedback`` and ``export`` do the rest (see README, "Instructors", and docs/grading.md).
"""

import importlib.util
import os
import shutil
import sys

from jupyter_client.manager import AsyncKernelManager
from nbgrader import utils
from nbgrader.api import MissingEntry
from nbgrader.converters.autograde import Autograde
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor, OverwriteCells
from nbformat.v4 import new_code_cell, new_output

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = "scaling-pytorch-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "gradebook.db")
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "runs"]

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# The grading kernel inherits this process's environment (jupyter_client copies os.environ). DeepSpeed
# JIT-builds its CPU comm op on first use, about a minute, past the cell limit above in notebook 09's
# first graded launch: point the kernel at the op `make setup` built (.venv/torch_extensions, next to the
# Python that runs nbgrader), unless the caller chose a folder (make, the images and .ci/run do). The same rule as
# course_lib.launch.extensions_dir(), written out: importing course_lib would load torch into every nbgrader command.
if sys.prefix != sys.base_prefix:  # in the course's venv
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


# ---------------------------------------------------------------- the grading kernel runs in a sandbox
# Autograde runs each submission's cells in a kernel. Unfenced, that kernel has the grader's rights: a solution
# cell could read solutions/, the hidden tests and the instructor's course_lib (every graded reference), or open
# gradebook.db and write its own grades. So the kernel starts through course_lib.apps.sandbox (Landlock): it reads the
# Python installation, the system folders, the student edition of course_lib (first on PYTHONPATH, so `import
# course_lib` finds the student's, stubbed one) and its own submission; it writes a fresh scratch folder (HOME,
# TMPDIR, caches, COURSE_RUN_DIR) and its own autograded folder. Nothing else of the course can be opened.
# nbgrader's own processes (outside the kernel) are unchanged. COURSE_GRADE_UNSANDBOXED=1 grades without Landlock
# (practice only: the scores are then not class-safe).
def course_lib_file(name: str) -> str:
    """The instructor's course_lib/apps/<name>.py (beside this file, or the installed one), found without importing the
    package (that would load torch into every nbgrader command)."""
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "course_lib")
    spec = None if os.path.isdir(beside) else importlib.util.find_spec("course_lib")
    if not os.path.isdir(beside) and spec is None:
        raise RuntimeError("nbgrader cannot find course_lib: run it from the course folder, or install the course "
                           "(make setup, or pip install -e .) into the Python that runs nbgrader")
    return os.path.join(beside if spec is None else spec.submodule_search_locations[0], "apps", f"{name}.py")


def course_root() -> str:
    """The instructor's course folder: the one that holds the course_lib nbgrader grades with."""
    return os.path.dirname(os.path.dirname(os.path.dirname(course_lib_file("sandbox"))))


def load_module(name: str):
    """course_lib/apps/<name>.py loaded on its own: sandbox and edition use the standard library only."""
    spec = importlib.util.spec_from_file_location(f"_course_{name}", course_lib_file(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The cell limits (a cell 60 s, a solution cell 20 s, COURSE_CELL_TIMEOUT), nbclient's wait for a kernel's last
# outputs and an interrupted cell letting the notebook go on: the student's lab has the same (its Validate button
# reads that file), so a notebook that validates for the student runs within the limits it is graded with.
load_subconfig(os.path.join(course_root(), "docker", "student-lab", "nbgrader_config.py"))  # noqa: F821
CELL_TIMEOUT = c.Execute.timeout


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started through course_lib.apps.sandbox, with its own scratch folder (removed when the kernel is)."""

    scratch = None
    shm_before = None  # /dev/shm's names before the kernel started, where the kernel cannot have one of its own

    async def _async_pre_start_kernel(self, **kw):
        sandbox = load_module("sandbox")
        sandbox.refuse_root()
        if self.shm_before is None and not sandbox.shm_can_be_private():
            self.shm_before = set(os.listdir("/dev/shm"))
        if sandbox.landlock_abi() == 0:
            sandbox.restrict([], [])  # raises the clear error, or warns under COURSE_GRADE_UNSANDBOXED=1
        self.scratch = self.scratch or sandbox.scratch_folder()
        kw["cwd"] = kw.get("cwd") or self.scratch  # never nbgrader's own folder (the course root) by default
        submission = os.path.realpath(kw["cwd"])
        edition = load_module("edition")
        edition_path = str(edition.for_grading())
        kw["env"] = sandbox.grading_env(dict(kw.get("env") or os.environ), self.scratch, edition_path)
        cmd, kw = await super()._async_pre_start_kernel(**kw)
        read, write = sandbox.allow_lists([submission], self.scratch, [self.connection_file], edition.grading_cache(),
                                          edition_path, os.path.dirname(os.path.dirname(course_lib_file("sandbox"))))
        return sandbox.fenced(cmd, read, write), kw

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if not restart and self.shm_before is not None:  # what the kernel left in the machine's shared memory
            load_module("sandbox").clear_shm(self.shm_before)
            self.shm_before = None


class SandboxedExecute(Execute):
    """nbgrader's Execute with the sandboxed kernel (Execute's constructor picks the kernel manager itself,
    over any c.Execute.kernel_manager_class, so the class is chosen here)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)


# ---------------------------------------------------------------- scores come from the grader, not the kernel
# A test cell that calls check("grade_id", globals()) is scored here: course_lib.checks.grade runs the submission's
# setup and solution cells in a fenced child process, takes back its probes' data and judges it in this process.
# The verdict replaces what the kernel printed in that cell (an error output if it failed, the judge's message if
# it passed), and nbgrader's SaveAutoGrades then scores the cell from it. Nothing the kernel did (patched helpers,
# a rebound forbid, an AST transformer that swallows errors) reaches these cells' scores.
class GradeByChecks(NbGraderPreprocessor):
    """Write each checked test cell's verdict, computed outside the student's process, as that cell's output."""

    def preprocess(self, nb, resources):
        from course_lib.checks import grade  # torch: only in the autograde process, not every nbgrader command

        verdicts = grade.grade(nb, seconds=CELL_TIMEOUT)
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
    return ("FLAGGED by the grader for the instructor to review (course_lib.checks.audit):\n"
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


c.Autograde.autograde_preprocessors = autograde_preprocessors()
c.Autograde.sanitize_preprocessors = [CourseOverwriteCells if p is OverwriteCells else p
                                      for p in Autograde.sanitize_preprocessors.default()]
