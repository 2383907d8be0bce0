"""nbgrader configuration of the course: run nbgrader's commands from the project root. Settings only: the plugins
they select are course_grader.nbgrader_plugins.

solutions/<assignment>/<assignment>.ipynb is the source (one notebook per assignment);
``nbgrader generate_assignment`` writes release/, and ``python -m course_grader.release``
copies that into notebooks/ (committed, so a clone opens and runs with no instructor step).
Collected work goes to submitted/<student>/<assignment>/; ``nbgrader autograde``,
``generate_feedback`` and ``export`` do the rest (see README, "Instructors", and docs/grading.md).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(HERE, "course_grader")):  # the grader beside this file, over an installed copy
    sys.path.insert(0, HERE)
from course_grader import nbgrader_plugins as plugins  # noqa: E402 (nbgrader and the standard library: no torch)

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = "scaling-pytorch-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "gradebook.db")
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "runs"]

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# The grading kernel inherits this process's environment (jupyter_client copies os.environ). DeepSpeed
# JIT-builds its CPU comm op on first use, about a minute, past the cell limit below in notebook 09's
# first graded launch: point the kernel at the op `make setup` built (.venv/torch_extensions, next to the
# Python that runs nbgrader), unless the caller chose a folder (make, the images and .ci/run do). The same rule as
# course_lib.launch.extensions_dir(), written out: importing course_lib would load torch into every nbgrader command.
if sys.prefix != sys.base_prefix:  # in the course's venv
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# The cell limits (a cell 60 s, a solution cell 20 s, COURSE_CELL_TIMEOUT), nbclient's wait for a kernel's last
# outputs and an interrupted cell letting the notebook go on: the student's lab has the same (its Validate button
# reads that file), so a notebook that validates for the student runs within the limits it is graded with.
load_subconfig(plugins.STUDENT_LAB_CONFIG)  # noqa: F821
c.GradeByChecks.seconds = c.Execute.timeout

# Autograde runs each submission's cells in a kernel fenced by course_grader.sandbox (Landlock: it reads the Python
# installation, the student edition and its own submission; it writes a scratch folder), then scores every test cell
# that calls check() from the verdict course_grader.grade computes outside the student's process; a hidden test cell
# that arrives as the release made it is restored without a warning (course_grader.nbgrader_plugins says each one).
c.Autograde.autograde_preprocessors = plugins.autograde_preprocessors()
c.Autograde.sanitize_preprocessors = plugins.sanitize_preprocessors()
