"""nbgrader for a student's server on the hub: their hub name is their student id, the hub's service files submissions.

Every student's container runs as the same OS user (`student`), and nbgrader would take that name for every
submission; the hub tells each server whose it is in JUPYTERHUB_USER. Only student servers read this
folder (JUPYTER_CONFIG_PATH): the instructors' Formgrader must collect everyone, not one student.
Submitting goes through the hub's exchange service (course_exchange.py, next to this file): the lab only reads
the exchange, and the service takes the name from the lab's hub token and the time from its own clock.
"""

import os
import sys

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = "scaling-pytorch-training"  # as in the course's nbgrader_config.py
c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
# the shared exchange (start-lab.sh also writes it to ~/.jupyter; a SLURM lab runs without start-lab.sh)
if os.environ.get("NBGRADER_EXCHANGE"):
    c.Exchange.root = os.environ["NBGRADER_EXCHANGE"]

# the exchange plugins in course_exchange.py (this folder is mounted read-only into the containers)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
c.ExchangeFactory.submit = "course_exchange.HubSubmit"  # posts to the service; --student is ignored
c.ExchangeFactory.fetch_assignment = "course_exchange.HubFetchAssignment"  # these three only read the exchange
c.ExchangeFactory.fetch_feedback = "course_exchange.HubFetchFeedback"
c.ExchangeFactory.list = "course_exchange.HubList"
