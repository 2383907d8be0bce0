"""nbgrader in a student's lab: the course's cell limits, the same that autograde grades with.

The student's JupyterLab reads this folder through JUPYTER_CONFIG_PATH (`make lab`, docker/start-lab.sh's student
role, the class hub's labs), and so do the Validate button and `nbgrader validate`: a notebook that validates here
runs within the limits it is graded with. The course's nbgrader_config.py (the instructor's) loads this file, so
the limits have this one home.
"""

import os

c = get_config()  # noqa: F821 (nbgrader provides it)

# A cell that runs longer than this is interrupted and the notebook goes on: a submission that loops forever loses
# that exercise's points, not the whole notebook. While nbgrader validates or grades, the notebooks pick the 'smoke'
# tier (tiny sizes), so no honest cell comes near it.
CELL_TIMEOUT = int(os.environ.get("COURSE_CELL_TIMEOUT", "60"))
# A solution cell only defines the student's functions and classes (the test cells after it run them), so it gets a
# shorter limit: a loop written at its top level costs 20 s, not the full limit.
SOLUTION_CELL_TIMEOUT = min(20, CELL_TIMEOUT)


def cell_timeout(cell) -> int:
    """Seconds a cell may run: the solution cells' limit or the general one."""
    return SOLUTION_CELL_TIMEOUT if cell.metadata.get("nbgrader", {}).get("solution") else CELL_TIMEOUT


c.Execute.timeout = CELL_TIMEOUT
c.Execute.timeout_func = cell_timeout
c.Execute.interrupt_on_timeout = True
# After a cell's reply, nbclient waits this long for the kernel's last output messages, and nbgrader's Execute
# (raise_on_iopub_timeout) fails the whole notebook when they come later. nbclient's 4 s was passed on a loaded
# 2-core machine: every student but one lost their grading at notebook 00's bert-base cell. A healthy kernel sends
# them at once; this only bounds a kernel that stalls.
c.Execute.iopub_timeout = 60
