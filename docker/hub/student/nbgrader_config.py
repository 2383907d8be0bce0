"""nbgrader for a student's server on the hub: their hub name is their student id.

Every student's container runs as the same OS user (`student`), and nbgrader would take that name for every
submission; the hub tells each server whose it is in JUPYTERHUB_USER. Only student servers read this
folder (JUPYTER_CONFIG_PATH): the instructors' Formgrader must collect everyone, not one student.
"""

import os

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = "scaling-pytorch-training"  # as in the course's nbgrader_config.py
c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
# the shared exchange (start-lab.sh also writes it to ~/.jupyter; a SLURM lab runs without start-lab.sh)
if os.environ.get("NBGRADER_EXCHANGE"):
    c.Exchange.root = os.environ["NBGRADER_EXCHANGE"]
