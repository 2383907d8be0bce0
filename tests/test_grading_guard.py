"""The grading process against a submission that attacks it: what its audit hook refuses and reports, what the
server contains, and what the grader accepts back (course_grader.audit, child, grade).

Each job here runs cells in a real fork of a real grading server (``grade.Server``), fenced as in grading; the
probes' data is then judged in this process. The whole-notebook attacks (forbid disarmed, the results rewritten
on their way out) are cases of every assignment in tests/submissions/attacks.py, graded by test_grading.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from course_grader import checks, grade


SECRET = "INSTRUCTOR_API_TOKEN"


@pytest.fixture(scope="module")
def server():
    """A grading server started by a grader whose environment holds a secret."""
    os.environ[SECRET] = "s3cret"
    try:
        running = grade.Server([])
    finally:
        del os.environ[SECRET]
    yield running
    running.close()


def run(server, cells: list[str], names=(), fence=True) -> dict:
    return server.run(cells, list(names), seconds=30, fence=fence)


def kinds(out: dict) -> list[tuple[str, bool]]:
    return [(r["kind"], r["refused"]) for r in out["reports"]]


def test_a_walk_of_the_object_graph_is_refused_and_reported(server):
    out = run(server, ["import gc\nfound = len(gc.get_objects())\n",
                       "import gc\ngc.get_referents(dict)\n"])
    assert [e.split(":")[1].strip() for e in out["cell_errors"]] == ["GraderRefused", "GraderRefused"], out
    assert kinds(out) == [("gc.get_objects", True), ("gc.get_referents", True)]


def test_the_results_are_written_as_the_probes_made_them(server):
    """A cell that rewrites torch's saving (every probe's data on its way out) is undone before the results are
    written: the probe's own error comes back, not the forged pass."""
    out = run(server, ["import torch.serialization\n"
                       "_real = torch.serialization._save\n"
                       "def _forged(obj, *args, **kwargs):\n"
                       "    if isinstance(obj, dict) and 'results' in obj:\n"
                       "        obj = {'results': {n: {'data': []} for n in obj['results']}, 'cell_errors': []}\n"
                       "    return _real(obj, *args, **kwargs)\n"
                       "torch.serialization._save = _forged\n"], names=["test_DynamicLossScaler"])
    assert "error" in out["results"]["test_DynamicLossScaler"], out


def test_rebinding_a_library_function_s_code_is_refused_but_the_student_s_own_is_not(server):
    out = run(server, [
        "import contextlib\n"
        "contextlib.nullcontext.__enter__.__code__ = (lambda self: None).__code__\n",
        "import course_grader.grading\n"
        "course_grader.grading.forbid.__enter__.__defaults__ = (1,)\n",
        "def mine(x):\n    return x\nmine.__code__ = (lambda x: 2 * x).__code__\nassert mine(2) == 4\n"])
    assert len(out["cell_errors"]) == 2 and all("GraderRefused" in e for e in out["cell_errors"]), out
    assert kinds(out) == [("rebinding a library function's code", True)] * 2
    assert "contextlib.nullcontext.__enter__.__code__" in out["reports"][0]["detail"]


def test_a_copy_of_the_library_s_code_or_a_second_run_of_its_module_is_refused(server):
    out = run(server, [
        "import types, course_lib.memory\n"
        "copy = types.FunctionType(course_lib.memory.tensor_bytes.__code__, vars(course_lib.memory))\n",
        "import course_lib.memory\n"
        "renamed = course_lib.memory.tensor_bytes.__code__.replace(co_filename='<mine>')\n",
        "import importlib, course_lib.memory\nimportlib.reload(course_lib.memory)\n",
        "import runpy, course_lib.memory\nrunpy.run_path(course_lib.memory.__file__)\n"])
    assert len(out["cell_errors"]) == 4 and all("GraderRefused" in e for e in out["cell_errors"]), out
    assert ("a copy of the library's code", True) in kinds(out)
    assert ("running a loaded module again", True) in kinds(out)
    assert ("compiling a loaded module's file", False) in kinds(out)


def test_pasting_the_source_of_a_forbidden_answer_is_flagged(server):
    """The student edition's graded answers are stubs; an answer forbidden but given (or torch's) is compared with
    what the student's cells compile."""
    import inspect

    source = inspect.getsource(torch.amp.GradScaler.unscale_)
    out = run(server, ["import textwrap\nexec(textwrap.dedent(" + repr(source) + "))\n"],
              names=["test_DynamicLossScaler"])
    assert ("the source of a forbidden answer", False) in kinds(out), out["reports"]
    clean = run(server, ["def unscale_(x):\n    return x\n"], names=["test_DynamicLossScaler"])
    assert clean["reports"] == []


def test_a_daemon_a_job_leaves_behind_is_killed_when_the_job_ends(server, tmp_path):
    """A double-forked process in a session of its own leaves the job's process group; the server, its subreaper,
    kills it before it answers."""
    pid_file = tmp_path / "daemon.pid"
    out = run(server, [
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "        while True:\n"
        "            time.sleep(1)\n"
        "    os._exit(0)\n"
        "time.sleep(1)\n"], fence=False)
    assert out["cell_errors"] == [], out
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_job_s_files_are_limited_in_size_and_the_grader_s_secrets_are_not_in_its_environment(server):
    out = run(server, ["import os, resource\nassert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == 1 << 30\n"
                       "assert resource.getrlimit(resource.RLIMIT_CORE)[0] == 0\n",
                       f"assert {SECRET!r} not in os.environ and 'PATH' in os.environ\n"])
    assert out["cell_errors"] == [], out


def test_a_job_that_allocates_without_end_fails_in_its_own_process(server):
    from course_grader import child

    out = run(server, ["import resource\n"
                       f"assert resource.getrlimit(resource.RLIMIT_DATA)[0] == {child.MEMORY_LIMIT}\n",
                       f"hoard = bytearray({child.MEMORY_LIMIT})\n",
                       "print('still graded')\n"])
    assert len(out["cell_errors"]) == 1 and "MemoryError" in out["cell_errors"][0], out


def test_what_a_job_leaves_in_shared_memory_is_not_there_for_the_next(server):
    """A file in /dev/shm outlives its process on a shared tmpfs: a student could leave answers, or a trap, for the
    next student graded. Each job has its own (or the server removes what the job left)."""
    name = f"/dev/shm/course-left-behind-{os.getpid()}"
    first = run(server, [f"open({name!r}, 'w').write('answers')\nassert open({name!r}).read() == 'answers'\n"])
    assert first["cell_errors"] == [], first
    assert not os.path.exists(name)
    second = run(server, [f"import os\nassert not os.path.exists({name!r}), 'the last job left it'\n"])
    assert second["cell_errors"] == [], second


def test_a_job_that_switches_its_alarm_off_is_killed_by_the_server(server):
    """The fork's alarm is the student's to ignore; the server kills the job a grace period past the cell's limit,
    not at the end of the whole job's allowance."""
    from course_grader import child

    start = time.monotonic()
    out = server.run(["import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n",
                      "while True:\n    pass\n", "print('never')\n"], ["test_DynamicLossScaler"], seconds=2)
    took = time.monotonic() - start
    assert "wrote no results" in out["cell_errors"][0], out
    assert took < 2 + child.GRACE + 30, f"the server let a job that ignores its alarm run {took:.0f} s"


def test_grading_refuses_root_unless_told_it_is_a_throwaway_container(monkeypatch, capsys):
    from course_grader import sandbox

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv(sandbox.AS_ROOT, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match="refuses to run as root"):
        sandbox.refuse_root()
    monkeypatch.setenv(sandbox.AS_ROOT, "1")
    sandbox.refuse_root()
    assert "grading as root" in capsys.readouterr().err
    kept = sandbox.scrubbed({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y",
                             "GITHUB_TOKEN": "z", "COURSE_CELL_TIMEOUT": "60", "HOME": "/root"})
    assert kept == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "COURSE_CELL_TIMEOUT": "60"}


def test_the_grader_refuses_data_no_judge_should_read():
    """A stride-0 tensor of a few bytes claims 2**27 elements; a view is made dense; anything not plain is refused."""
    huge = torch.zeros(1).expand(1 << 27)
    overlapping = torch.as_strided(torch.zeros(4), (1 << 10,), (0,))
    for data in ([huge], {"x": overlapping}, [[[[]]]] * (grade.MAX_ITEMS + 1)):
        with pytest.raises(grade.Malformed):
            grade.validated(data)
    deep = []
    for _ in range(grade.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(grade.Malformed, match="deep"):
        grade.validated(deep)
    base = torch.arange(12.0).reshape(3, 4)
    got = grade.validated({"t": base.t(), "row": base[1], "n": [1, 2.5, "s", None, True]})
    assert got["t"].is_contiguous() and torch.equal(got["t"], base.t()) and got["row"].storage_offset() == 0
    checks.load_all()
    verdict = grade.judge("test_DynamicLossScaler", {"data": {"scales": [huge]}}, [])
    assert not verdict.passed and "not plain data" in verdict.message


def test_a_hidden_test_s_feedback_names_the_error_not_its_text():
    """The student's code could put a hidden input in its exception: the feedback of a hidden test shows the
    error's type and line, a visible test's shows the text."""
    checks.load_all()
    hidden = next(n for n, c in checks.REGISTRY.items() if c.probe.__module__.endswith("_hidden"))
    visible = next(n for n, c in checks.REGISTRY.items() if not c.probe.__module__.endswith("_hidden"))
    error = {"error": "ValueError: SIZES=[3, 5, 7] (line 2 of <cell 4>)", "type": "ValueError",
             "where": " (line 2 of <cell 4>)"}
    assert "SIZES" not in grade.judge(hidden, error, []).message
    assert "ValueError" in grade.judge(hidden, error, []).message and "line 2" in grade.judge(hidden, error, []).message
    assert "SIZES=[3, 5, 7]" in grade.judge(visible, error, []).message


class RecordingServer(grade.Server):
    """A real grading server that notes the seed each grading handed it."""

    seeds: list

    def run(self, cells, names, seconds, fence=True, seed=0):
        self.seeds.append(seed)
        return super().run(cells, names, seconds, fence, seed)


def test_hidden_cases_come_from_each_gradings_secret_seed():
    """06's hidden sampler test draws its seed from the grading's: two gradings ask for different batches, each
    judged right under its own seed; the data that answered one grading fails under another's; and ``grade`` draws
    a new seed every time."""
    import nbgrading as g

    name = "test_rank_batches_hidden"
    solution = g.load_solution("06_ddp")
    nb = g.submission(solution, solution)
    running = RecordingServer(grade.hidden_modules([name]))
    running.seeds = []
    try:
        cells = grade.cells_to_run(nb)
        first = running.run(cells, [name], 60, seed=11)["results"][name]
        second = running.run(cells, [name], 60, seed=12)["results"][name]
        verdicts = [grade.grade(nb, server=running, only={name}) for _ in range(2)]
    finally:
        running.close()
    assert first["data"]["seeded"] != second["data"]["seeded"], "the same hidden batches at two gradings"
    assert grade.judge(name, first, [], seed=11).passed and grade.judge(name, second, [], seed=12).passed
    assert not grade.judge(name, first, [], seed=12).passed, "an earlier grading's answers pass a later one"
    assert all(v[name].passed for v in verdicts)
    drawn = running.seeds[2:]
    assert len(drawn) == 2 and drawn[0] != drawn[1], f"grade() drew the seeds {drawn}"
    with checks.grading_seed(11):
        eleven = checks.case_seed("sampler")
    assert eleven != checks.case_seed("sampler") and checks.GRADING_SEED == 0  # the block's seed, then the default


def test_the_grader_s_own_rank_records_where_the_student_s_process_cannot_reach(server, tmp_path, monkeypatch):
    """07's buckets check: its rank 0 is the grader's (course_grader.peer), forked from the server before the job,
    and records what reached it in a folder outside the fence. A cell that lists that folder or writes a record into
    it is refused; the record the judge reads is rank 0's: the reference solution passes on it, and the same data
    with the record emptied or with another sum in it fails."""
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from solved import solution

    wires, real = tmp_path / "wires", tempfile.mkdtemp
    wires.mkdir()
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix=None, **kw: str(wires) if prefix == "course-wire-"
                        else real(prefix=prefix, **kw))
    name = "test_BucketedDDP_buckets"
    reach = (f"import os\nfound = os.listdir({str(wires)!r})\n",
             f"open({str(wires / (name + '.pt'))!r}, 'wb').write(b'forged')\n")
    cells = ["import torch\nimport torch.distributed as dist\nimport functools\n",
             solution("07_ddp_reducer", "BucketedDDP"), *reach]
    out = server.run(cells, [name], seconds=30)
    assert [e.split(":")[1].strip() for e in out["cell_errors"]] == ["PermissionError", "PermissionError"], out
    result = out["results"][name]
    events = [e["what"] for e in result["wire"]]
    assert events[:3] == ["round", "broadcast", "reached"] and events[-1] == "done", events
    assert grade.judge(name, result, []).passed, grade.judge(name, result, []).message
    assert not grade.judge(name, {**result, "wire": []}, []).passed
    forged = [{**e, "sum": e["sum"] * 1.01} if e["what"] == "arrived" else e for e in result["wire"]]
    assert "another sum" in grade.judge(name, {**result, "wire": forged}, []).message


def test_the_grader_s_rank_waits_for_its_probe_as_long_as_the_job_may_run(server):
    """The grader's rank starts before the job and its probe runs after the submission's cells: cells that together
    take longer than one cell's limit must not leave the probe without its rank 0."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from solved import solution

    name = "test_BucketedDDP_buckets"
    cells = ["import time\ntime.sleep(7)\n", "import time\ntime.sleep(7)\n",
             "import torch\nimport torch.distributed as dist\nimport functools\n",
             solution("07_ddp_reducer", "BucketedDDP")]
    out = server.run(cells, [name], seconds=10)
    assert not out["cell_errors"], out["cell_errors"]
    verdict = grade.judge(name, out["results"][name], [])
    assert verdict.passed, verdict.message


def test_a_peers_record_is_cut_into_its_rounds_and_a_round_never_reached_is_empty():
    """A judge reads each wired round's events alone: a round that stopped early holds what it saw, and a round the
    peer never reached (it was still waiting in an earlier one) is empty, so that round's judge says it never came."""
    from course_grader.peer import rounds

    wire = [{"what": "round", "index": 0}, {"what": "arrived", "step": 0}, {"what": "stopped", "message": "gone"},
            {"what": "round", "index": 1}, {"what": "arrived", "step": 1}, {"what": "done"}]
    assert rounds(wire, 3) == [[wire[1], wire[2]], [wire[4], wire[5]], []]
    assert rounds(wire, 1) == [[wire[1], wire[2]]]
    assert rounds([], 2) == [[], []]


def test_a_peer_hosts_each_round_with_that_round_s_world():
    """A peer with one world size per round (15's rings of 2 and 3 ranks) hosts each round's group at its size: ranks
    that join round 1 as a world of 3 meet rank 0 there, and round 0's 2 ranks meet it in theirs."""
    import tempfile

    import torch.distributed as dist

    from course_grader import peer as peers
    from course_lib.launch import run_forked

    def play(wire, round):
        total = torch.ones(1)
        dist.all_reduce(total)
        wire.record("sum", round=round, value=float(total))

    def rank():
        total = torch.ones(1)
        dist.all_reduce(total)
        return dist.get_world_size()

    spec = peers.Peer(world=(2, 3), play=play, rounds=2)
    with tempfile.TemporaryDirectory() as folder:
        started = peers.start(spec, Path(folder) / "wire.pt", 0, 30)
        sizes = [run_forked(rank, world - 1, timeout=20, join=(started.ports[i], 1))
                 for i, world in enumerate((2, 3))]
        wire = started.finish()
    assert sizes == [[2], [3, 3]]
    assert [[e["value"] for e in events if e["what"] == "sum"] for events in peers.rounds(wire, 2)] == [[2.0], [3.0]]


def test_join_ranks_names_an_unwritten_exercise_and_reports_an_error_or_a_deadlock_as_data():
    """The probe's side of a wired check: a rank that met a release's stub (NotImplementedError) raises, so the test
    names the exercise; any other error, and ranks still waiting at the timeout (a deadlock), come back as data,
    told apart, for the judge to read beside rank 0's record."""
    import tempfile
    import time

    import torch.distributed as dist

    from course_grader import peer as peers
    from course_lib.launch import WorkerError

    def play(wire, round):
        total = torch.ones(1)
        dist.all_reduce(total)
        wire.record("sum", value=float(total))

    def unwritten():
        raise NotImplementedError("write tensor_parallel_pair")

    def broken():
        raise ValueError("a bug of the student's")

    def waits():
        time.sleep(30)

    spec = peers.Peer(world=2, play=play, rounds=3)
    with tempfile.TemporaryDirectory() as folder:
        started = peers.start(spec, Path(folder) / "wire.pt", 0, 20)
        with pytest.raises(WorkerError, match="write tensor_parallel_pair") as raised:
            peers.join_ranks(unwritten, 1, port=started.ports[0], timeout=10)
        assert raised.value.kind == "NotImplementedError"
        stopped = peers.join_ranks(broken, 1, port=started.ports[1], timeout=10)
        waited = peers.join_ranks(waits, 1, port=started.ports[2], timeout=2)
        started.finish()
    assert len(stopped) == 1 and "a bug of the student's" in stopped[0]["stopped"] and not stopped[0]["timed out"]
    assert len(waited) == 1 and waited[0]["timed out"]
