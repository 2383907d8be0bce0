"""nbgrader for the hub's grader service (the Formgrader): collect what the exchange service filed, nothing else.

Students cannot write inbound/: the exchange service (../exchange_service.py) files each submission there as the
grader and records it in a ledger. grader_exchange.py (next to this file) collects only ledger entries whose
files are unchanged, under the ledger's user and time, and logs what it skipped; its release and feedback
leave the exchange root's mode alone (it is root's). Read through JUPYTER_CONFIG_PATH by the grader service only.
"""

import os
import sys

c = get_config()  # noqa: F821 (nbgrader provides it)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
c.ExchangeFactory.collect = "grader_exchange.LedgerCollect"
c.ExchangeFactory.release_assignment = "grader_exchange.GraderReleaseAssignment"
c.ExchangeFactory.release_feedback = "grader_exchange.GraderReleaseFeedback"
c.LedgerCollect.ledger = os.environ["COURSE_EXCHANGE_LEDGER"]  # set by jupyterhub_config.py
# every inbound folder is the grader's (the service wrote it): the owner check could only cry wolf
c.CollectApp.check_owner = False
