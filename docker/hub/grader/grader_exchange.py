"""nbgrader's exchange for the hub's grader: collect only what the exchange service filed, as it filed it.

The exchange service (docker/hub/exchange_service.py) writes each submission into inbound/ and appends a ledger
line: the hub user, the assignment, its own timestamp, the folder and the sha256 of every file. This collect
takes the name and the time from that line, never from a folder's name, and only when the folder still holds
exactly those files. Anything else in inbound/ (a folder written there by hand, a ledger entry whose files
changed or went) is skipped and logged with the reason.

The exchange's root folder is root's (start.sh), so no student can rename the course folder away and put one
of their own in its place; the grader owns <root>/<course>/. nbgrader's release would make the root 0777 (and
fails when it cannot): here release, feedback and collect check the course folder instead.
nbgrader_config.py in this folder selects these classes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.exchange.default import ExchangeCollect, ExchangeReleaseAssignment, ExchangeReleaseFeedback
from nbgrader.utils import check_directory, check_mode, parse_utc
from traitlets import Unicode


def files_of(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under folder."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def read_ledger(path: Path, assignment: str) -> dict[str, dict]:
    """The ledger's entries for one assignment, by inbound folder name."""
    if not path.exists():
        return {}
    entries = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {e["folder"]: e for e in entries if e["assignment"] == assignment}


class CourseFolderRoot:
    """The grader writes <root>/<course>/, never the root itself: check that, and leave the root's mode alone."""

    def ensure_root(self) -> None:
        course = os.path.join(self.root, self.coursedir.course_id)
        mine = course if os.path.exists(course) else self.root  # nbgrader makes a missing course folder
        if not check_directory(mine, write=True, execute=True):
            self.fail(f"{mine} is not writable by this user: start.sh makes {course} the grader's (run it again)")


class GraderReleaseAssignment(CourseFolderRoot, ExchangeReleaseAssignment):
    """nbgrader's release, into the grader's course folder."""


class GraderReleaseFeedback(CourseFolderRoot, ExchangeReleaseFeedback):
    """nbgrader's feedback release, into the grader's course folder, readable by the student it is for."""

    def copy_files(self) -> None:
        super().copy_files()
        # nbgrader copies the feedback file's mode from the grader's folder, which may be private; the students
        # (another uid) find theirs by its hashed name in feedback/ (0711), so the file itself must be readable
        for page in Path(self.dest_path).glob("*.html"):
            if page.stat().st_uid == os.getuid():
                page.chmod(0o644)


class LedgerCollect(CourseFolderRoot, ExchangeCollect):
    """Collect the submissions the exchange service filed, under the ledger's user and timestamp."""

    ledger = Unicode(os.environ.get("COURSE_EXCHANGE_LEDGER", ""),
                     help="The exchange service's ledger (COURSE_EXCHANGE_LEDGER)").tag(config=True)

    def verified_records(self) -> list[dict]:
        """One record per ledger entry whose folder holds exactly the files the service wrote; log every skip."""
        if not self.ledger:
            self.fail("LedgerCollect.ledger is not set: the hub passes COURSE_EXCHANGE_LEDGER to the grader")
        entries = read_ledger(Path(self.ledger), self.coursedir.assignment_id)
        wanted = self.coursedir.student_id or "*"
        records = []
        for folder in sorted(Path(self.inbound_path).glob(f"*+{self.coursedir.assignment_id}+*")):
            entry = entries.get(folder.name)
            if entry is None:
                self.log.warning("Skipped %s: the exchange service did not file it (written into inbound/ by "
                                 "other means; its name and time are not trusted)", folder.name)
            elif not folder.is_dir() or files_of(folder) != entry["files"]:
                self.log.warning("Skipped %s: its files differ from what the exchange service filed for %s at %s",
                                 folder.name, entry["user"], entry["timestamp"])
            elif wanted in ("*", entry["user"]):
                records.append({"username": entry["user"], "filename": folder.name,
                                "timestamp": parse_utc(entry["timestamp"])})
        return records

    def init_src(self) -> None:
        if self.coursedir.course_id == "":
            self.fail("No course id specified. Re-run with --course flag.")
        self.course_path = os.path.join(self.root, self.coursedir.course_id)
        self.inbound_path = os.path.join(self.course_path, "inbound")
        if not os.path.isdir(self.inbound_path):
            self.fail(f"Course not found: {self.inbound_path}")
        if not check_mode(self.inbound_path, read=True, execute=True):
            self.fail(f"You don't have read permissions for the directory: {self.inbound_path}")
        by_user = defaultdict(list)
        for record in self.verified_records():
            by_user[record["username"]].append(record)
        with Gradebook(self.coursedir.db_url, self.coursedir.course_id) as gb:
            try:
                self.duedate = gb.find_assignment(self.coursedir.assignment_id).duedate
            except MissingEntry:
                self.duedate = None
        self.src_records = []
        for records in by_user.values():  # as nbgrader's collect: the newest, or the newest before the due date
            records = self._sort_by_timestamp(records)
            on_time = [r for r in records if self.duedate and r["timestamp"] <= self.duedate]
            self.src_records.append(on_time[0] if self.before_duedate and on_time else records[0])
