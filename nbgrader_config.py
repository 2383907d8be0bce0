"""nbgrader configuration of the course: run nbgrader's commands from the project root.

solutions/<assignment>/<assignment>.ipynb is the source (one notebook per assignment);
``nbgrader generate_assignment`` writes release/, and ``python -m course_lib.release``
copies that into notebooks/ (committed, so a clone opens and runs with no instructor step).
Collected work goes to submitted/<student>/<assignment>/; ``nbgrader autograde``,
``generate_feedback`` and ``export`` do the rest (see README, "Grading").
"""

import os
import sys

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

# A cell that runs longer than this is interrupted and the notebook goes on: a submission that
# loops forever loses that exercise's points, not the whole notebook. Under nbgrader the
# notebooks pick the 'smoke' tier (tiny sizes), so no honest cell comes near it.
CELL_TIMEOUT = int(os.environ.get("COURSE_CELL_TIMEOUT", "60"))
# A solution cell only defines the student's functions and classes (the test cells after it run
# them), so it gets a shorter limit: a loop written at its top level costs 20 s, not the full limit.
SOLUTION_CELL_TIMEOUT = min(20, CELL_TIMEOUT)


def cell_timeout(cell) -> int:
    """Seconds a cell may run under autograde: the solution cells' limit or the general one."""
    return SOLUTION_CELL_TIMEOUT if cell.metadata.get("nbgrader", {}).get("solution") else CELL_TIMEOUT


c.Execute.timeout = CELL_TIMEOUT
c.Execute.timeout_func = cell_timeout
c.Execute.interrupt_on_timeout = True
c.Execute.allow_errors = True

# The grading kernel inherits this process's environment (jupyter_client copies os.environ). DeepSpeed
# JIT-builds its CPU comm op on first use, about a minute, past the cell limit above in notebook 06's
# first graded launch: point the kernel at the op `make setup` built (.venv/torch_extensions, next to the
# Python that runs nbgrader), unless the caller chose a folder (make, the images and .ci/run do).
if sys.prefix != sys.base_prefix:  # in the course's venv
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
