"""The class's submission desk: a JupyterHub service that files nbgrader submissions itself.

nbgrader's default exchange lets a student's lab write into the shared inbound/ folder, so the lab chooses
the name (`nbgrader submit --student=<anyone>`) and the time (the folder's name) a submission is collected
under. Here the lab only posts its files: this service learns who is posting from the hub (the lab's
JUPYTERHUB_API_TOKEN), stamps the time itself, writes inbound/<user>+<assignment>+<time>+<random>/ as the
grader, and appends what it wrote (user, assignment, time, sha256 of every file) to a ledger that the
grader's collect (grader/grader_exchange.py) trusts instead of folder names.

    POST <prefix>submit/<assignment>   {"files": {"relative/path": "<base64>", ...}}
        201 {"user", "assignment", "timestamp", "folder", "secret", "files": {path: sha256}}
        403 no hub token, not a user's token, or a user who is not a student of the class
        404 the assignment is not released (no outbound/<assignment>/)
        413 more than COURSE_EXCHANGE_MAX_MB of files
        400 a malformed request, or a path that leaves the submission folder
    GET  <prefix>                      what this service is (no token needed)

JupyterHub starts it (jupyterhub_config.py) with its own JUPYTERHUB_* variables and:
    COURSE_EXCHANGE_ROOT, COURSE_ID       nbgrader's exchange folder and the course in it
    COURSE_EXCHANGE_STUDENTS              the class: comma-separated hub names allowed to submit
    COURSE_EXCHANGE_LEDGER                the ledger, a JSON line per submission (the grader's file)
    COURSE_EXCHANGE_MAX_MB                the size limit of one submission (default 100, nbgrader's max_dir_size)
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from jupyterhub.services.auth import HubAuth
from tornado import ioloop, web
from tornado.log import app_log, enable_pretty_logging

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # assignment ids: no '+', '/', '..' or spaces
RESERVED = {"timestamp.txt", "submission_secret.txt"}  # nbgrader's own files in a submission: this service writes them
TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S.%f %Z"  # nbgrader's Exchange.timestamp_format, in UTC as nbgrader's default


@dataclass
class Desk:
    """Where submissions go and who may make them."""
    root: Path
    course: str
    students: frozenset[str]
    ledger: Path
    max_bytes: int

    @property
    def inbound(self) -> Path:
        return self.root / self.course / "inbound"

    def released(self, assignment: str) -> bool:
        return bool(SAFE_NAME.match(assignment)) and (self.root / self.course / "outbound" / assignment).is_dir()


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def decode_files(body: bytes, max_bytes: int) -> dict[str, bytes]:
    """The request's {"files": {path: base64}} as {path: bytes}; HTTPError 400/413 with the reason if it is not fit."""
    try:
        files = json.loads(body)["files"]
        assert isinstance(files, dict) and files, "no files"
        data = {str(name): base64.b64decode(text, validate=True) for name, text in files.items()}
    except (ValueError, KeyError, TypeError, AssertionError, binascii.Error) as e:
        raise web.HTTPError(400, reason=f'expected JSON {{"files": {{path: base64}}}} with at least one file ({e})')
    size = sum(len(b) for b in data.values())
    if size > max_bytes:
        raise web.HTTPError(413, reason=f"the submission holds {size / 1e6:.1f} MB of files, more than the "
                                        f"{max_bytes / 1e6:.1f} MB limit: remove data, checkpoints or outputs")
    for name in data:
        parts = PurePosixPath(name).parts
        if name.startswith("/") or "\\" in name or not parts or any(p in ("..", ".", "") for p in parts):
            raise web.HTTPError(400, reason=f"{name!r}: file paths must be relative and stay inside the assignment")
    return {name: b for name, b in data.items() if name not in RESERVED}


def write_submission(desk: Desk, user: str, assignment: str, files: dict[str, bytes]) -> dict:
    """File the submission under the hub's name and this server's time, append it to the ledger, return the entry."""
    timestamp = datetime.datetime.now(datetime.timezone.utc).strftime(TIMESTAMP_FORMAT)
    folder = desk.inbound / f"{user}+{assignment}+{timestamp}+{secrets.token_urlsafe(9)}"
    desk.inbound.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o750)  # new, never an existing one: the random part makes it unique
    secret = secrets.token_hex(64)  # as nbgrader's submit: names the feedback files of this submission
    for name, data in {**files, "timestamp.txt": timestamp.encode(), "submission_secret.txt": secret.encode()}.items():
        path = folder / name
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        path.write_bytes(data)
    written = {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    entry = dict(user=user, assignment=assignment, timestamp=timestamp, folder=folder.name, files=written)
    desk.ledger.parent.mkdir(parents=True, exist_ok=True)
    with open(desk.ledger, "a") as f:  # one line per submission; tornado runs one handler at a time
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return {**entry, "secret": secret}


class SubmitHandler(web.RequestHandler):
    """POST submit/<assignment>: who is posting comes from the hub, never from the request."""

    def initialize(self, desk: Desk, hub_auth: HubAuth) -> None:
        self.desk, self.hub_auth = desk, hub_auth

    async def student(self) -> str:
        """The hub user behind the request's token, if they may submit; HTTPError 403 saying why otherwise."""
        model = await self.hub_auth.get_user(self, sync=False)
        if not model:
            raise web.HTTPError(403, reason="no valid JupyterHub token: submit from your own lab, whose "
                                            "JUPYTERHUB_API_TOKEN nbgrader sends")
        if model.get("kind", "user") != "user" or not self.hub_auth.check_scopes(self.hub_auth.access_scopes, model):
            raise web.HTTPError(403, reason=f"{model.get('kind')} {model.get('name')} may not submit: "
                                            "only a student's lab token can")
        if model["name"] not in self.desk.students:
            raise web.HTTPError(403, reason=f"{model['name']} is not a student of this class: only the users file's "
                                            "students submit (instructors test with a student account)")
        return model["name"]

    async def post(self, assignment: str) -> None:
        user = await self.student()
        if not self.desk.released(assignment):
            raise web.HTTPError(404, reason=f"no released assignment {assignment!r}: fetch one that the "
                                            "Assignment List shows as released")
        files = decode_files(self.request.body, self.desk.max_bytes)
        entry = write_submission(self.desk, user, assignment, files)
        app_log.info("filed %s for %s at %s (%d files)", entry["folder"], user, entry["timestamp"], len(files))
        self.set_status(201)
        self.finish(entry)

    def write_error(self, status_code: int, **kwargs) -> None:
        self.finish({"error": self._reason, "status": status_code})


class AboutHandler(web.RequestHandler):
    def get(self) -> None:
        self.finish({"service": "course exchange", "submit": "POST submit/<assignment> with the lab's hub token"})


def main() -> None:
    """Serve at JUPYTERHUB_SERVICE_URL under JUPYTERHUB_SERVICE_PREFIX, as JupyterHub starts its services."""
    env = os.environ
    max_mb = float(env.get("COURSE_EXCHANGE_MAX_MB", "100"))
    desk = Desk(root=Path(env["COURSE_EXCHANGE_ROOT"]), course=env["COURSE_ID"],
                students=frozenset(s for s in env["COURSE_EXCHANGE_STUDENTS"].split(",") if s),
                ledger=Path(env["COURSE_EXCHANGE_LEDGER"]), max_bytes=int(max_mb * 1e6))
    prefix = env.get("JUPYTERHUB_SERVICE_PREFIX", "/")
    hub_auth = HubAuth(cache_max_age=60)  # the hub's API and this service's token and scope from the environment
    app = web.Application([(prefix, AboutHandler), (rf"{prefix}submit/([^/]+)", SubmitHandler,
                                                     dict(desk=desk, hub_auth=hub_auth))])
    enable_pretty_logging()  # requests and what was filed, into the hub's log
    url = urlparse(env["JUPYTERHUB_SERVICE_URL"])
    # base64 inflates by 4/3; a bigger body is refused by tornado before it is read
    app.listen(url.port, address=url.hostname, max_body_size=int(desk.max_bytes * 4 / 3) + 2**20)
    print(f"course exchange: {url.geturl()}{prefix} files {sorted(desk.students)}'s submissions into {desk.inbound}",
          flush=True)
    ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main()
