"""nbgrader's exchange for a student's lab on the class hub: submit through the hub's exchange service.

The lab cannot write the exchange (its mount holds outbound/ and feedback/ only, read-only), so `nbgrader submit`
and the Assignment List's Submit button post the assignment's files to the `course-exchange` service
(docker/hub/exchange_service.py) with this lab's JUPYTERHUB_API_TOKEN. The service files the submission under
the hub user that token belongs to, at its own clock's time. The local cache entry nbgrader keeps (which the
Assignment List shows as submitted, and which feedback is matched against) is written as before, with the
service's timestamp and secret. nbgrader_config.py in this folder selects these classes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from nbgrader.exchange.default import ExchangeFetchAssignment, ExchangeFetchFeedback, ExchangeList, ExchangeSubmit
from nbgrader.utils import check_directory
from traitlets import Float, Unicode


class ReadOnlyRoot:
    """A student reads the exchange and never writes it: nbgrader's check that its root is writable becomes a check
    that it is readable (in the containers the exchange is a read-only mount)."""

    def ensure_root(self) -> None:
        if not check_directory(self.root, read=True, execute=True):
            self.fail(f"The exchange {self.root} is not readable here: ask your instructor (the hub mounts it)")


class HubFetchAssignment(ReadOnlyRoot, ExchangeFetchAssignment):
    """nbgrader's fetch, from a read-only exchange."""


class HubFetchFeedback(ReadOnlyRoot, ExchangeFetchFeedback):
    """nbgrader's feedback fetch, from a read-only exchange."""


class HubList(ReadOnlyRoot, ExchangeList):
    """nbgrader's list (released assignments, the submission cache), from a read-only exchange."""


class HubSubmit(ReadOnlyRoot, ExchangeSubmit):
    """Submit by posting the files to the hub's exchange service, which names and dates the submission itself."""

    url = Unicode(os.environ.get("COURSE_EXCHANGE_URL", ""),
                  help="The exchange service's base URL (…/services/course-exchange/), "
                       "reachable from this lab").tag(config=True)
    timeout = Float(300, help="Seconds to wait for the service to file a submission").tag(config=True)

    def init_dest(self) -> None:
        if self.coursedir.course_id == "":
            self.fail("No course id specified. Re-run with --course flag.")
        user = os.environ.get("JUPYTERHUB_USER", "")
        if not (user and os.environ.get("JUPYTERHUB_API_TOKEN") and self.url):
            self.fail("Submitting needs this lab's hub identity (JUPYTERHUB_USER, JUPYTERHUB_API_TOKEN) and the "
                      "exchange service (COURSE_EXCHANGE_URL): submit from a terminal or notebook of your hub lab")
        if self.coursedir.student_id not in ("*", "", user):
            self.log.warning("--student=%s is ignored: the hub files every submission from this lab under your hub "
                             "name, %s", self.coursedir.student_id, user)
        self.student = user
        self.cache_path = os.path.join(self.cache, self.coursedir.course_id)

    def post(self, files: dict[str, bytes]) -> dict:
        """POST the files to the service; its JSON answer, or fail with the service's reason."""
        body = json.dumps({"files": {k: base64.b64encode(v).decode() for k, v in files.items()}}).encode()
        request = urllib.request.Request(
            self.url.rstrip("/") + "/submit/" + self.coursedir.assignment_id, data=body, method="POST",
            headers={"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"],
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            try:
                reason = json.load(e)["error"]
            except ValueError:
                reason = e.reason
            self.fail(f"The exchange refused the submission ({e.code}): {reason}")
        except OSError as e:
            self.fail(f"The exchange service at {self.url} cannot be reached ({e}): ask your instructor")

    def copy_files(self) -> None:
        self.init_release()
        self.check_filename_diff()
        self.log.info("Source: %s", self.src_path)
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "submission"
            self.do_copy(self.src_path, str(staged))  # nbgrader's own ignore, include and size rules
            files = {str(p.relative_to(staged)): p.read_bytes() for p in sorted(staged.rglob("*")) if p.is_file()}
            filed = self.post(files)
            self.timestamp = filed["timestamp"]
            # nbgrader's cache entry: the Assignment List shows it as submitted, feedback is found through its secret
            cache_path = os.path.join(self.cache_path,
                                      f"{self.student}+{self.coursedir.assignment_id}+{self.timestamp}")
            os.makedirs(self.cache_path, exist_ok=True)
            shutil.copytree(staged, cache_path)
        Path(cache_path, "timestamp.txt").write_text(self.timestamp)
        Path(cache_path, "submission_secret.txt").write_text(filed["secret"])
        self.log.info("Submitted as: %s %s %s (filed by the hub as %s)", self.coursedir.course_id,
                      self.coursedir.assignment_id, self.timestamp, filed["user"])
