"""The grading sandbox for real: Landlock fences real processes, and the kernel nbgrader_config.py starts for
autograde imports the student edition of course_lib and cannot open the instructor's course folder.

Each process test runs the same child twice, fenced and not, so that it shows the fence (and not a missing
file or a permission) is what refuses. The kernel test starts the kernel with the grading config's own Execute
preprocessor, in a course folder laid out like the grader's (solutions/, gradebook.db, other students' folders).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from traitlets.config.loader import PyFileConfigLoader

from course_grader import sandbox
from course_grader.edition import for_grading

ROOT = Path(__file__).resolve().parent.parent
SANDBOX = ROOT / "course_grader" / "sandbox.py"
# what any Python child needs: the interpreter, its libraries, the system's
SYSTEM = sorted({sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix)}) + ["/usr", "/lib", "/lib64", "/bin",
                                                                                    "/etc", "/proc", "/dev"]

# A child that tries each action and reports "ok" or the error's name, by action.
TRY = textwrap.dedent('''
    import json, os, subprocess, sys
    def attempt(fn):
        try:
            fn()
            return "ok"
        except Exception as err:
            return type(err).__name__
    def write(path, text="x"):
        with open(path, "w") as f:
            f.write(text)
    def read(path):
        with open(path) as f:
            f.read()
''')


def run_child(code: str, read: list[str], write: list[str], fenced: bool = True) -> dict:
    """Run TRY + code in a child Python (through the sandbox's CLI when fenced); return the dict it prints."""
    command = [sys.executable, "-c", TRY + textwrap.dedent(code)]
    if fenced:
        command = [sys.executable, "-I", str(SANDBOX), "--read", *SYSTEM, *read, "--write", *write, "--", *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def tree(tmp_path) -> Path:
    """allowed/, denied/, mixed/ (one allowed file beside a denied one), writable/ and readonly/, each with a file."""
    for folder in ("allowed", "denied", "mixed", "writable", "readonly"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "file.txt").write_text(f"{folder}\n")
    (tmp_path / "mixed" / "secret.txt").write_text("secret\n")
    return tmp_path


def test_landlock_is_here():
    assert sandbox.landlock_abi() >= 1, \
        "grading needs Linux >= 5.13 with Landlock enabled (see course_grader/sandbox.py)"


def test_reads_only_what_it_is_given(tree):
    code = f'''
        t = {str(tree)!r}
        print(json.dumps({{name: attempt(lambda p=p: read(t + p)) for name, p in [
            ("allowed", "/allowed/file.txt"), ("denied", "/denied/file.txt"), ("file rule", "/mixed/file.txt"),
            ("beside it", "/mixed/secret.txt")]}} | {{"list denied": attempt(lambda: os.listdir(t + "/denied"))}}))
    '''
    read = [str(tree / "allowed"), str(tree / "mixed" / "file.txt"), str(tree / "no-such-folder")]  # missing: skipped
    fenced = run_child(code, read, [])
    assert fenced == {"allowed": "ok", "denied": "PermissionError", "file rule": "ok", "beside it": "PermissionError",
                      "list denied": "PermissionError"}
    assert set(run_child(code, read, [], fenced=False).values()) == {"ok"}  # unfenced, every read works


def test_writes_only_inside_its_write_list(tree):
    code = f'''
        t = {str(tree)!r}
        print(json.dumps({{
            "create in write list": attempt(lambda: write(t + "/writable/new.txt")),
            "mkdir in write list": attempt(lambda: os.mkdir(t + "/writable/sub")),
            "delete in write list": attempt(lambda: os.remove(t + "/writable/file.txt")),
            "overwrite read-only": attempt(lambda: write(t + "/readonly/file.txt")),
            "truncate read-only": attempt(lambda: os.truncate(t + "/readonly/file.txt", 0)),
            "delete read-only": attempt(lambda: os.remove(t + "/readonly/delete.txt")),
            "move out of read-only": attempt(lambda: os.rename(t + "/readonly/move.txt", t + "/writable/moved.txt")),
            "create outside": attempt(lambda: write(t + "/outside.txt")),
            "read read-only": attempt(lambda: read(t + "/readonly/file.txt")),
        }}))
    '''
    for name in ("delete.txt", "move.txt"):
        (tree / "readonly" / name).write_text("x\n")
    fenced = run_child(code, [str(tree / "readonly")], [str(tree / "writable")])
    assert fenced == {"create in write list": "ok", "mkdir in write list": "ok", "delete in write list": "ok",
                      "overwrite read-only": "PermissionError", "truncate read-only": "PermissionError",
                      "delete read-only": "PermissionError", "move out of read-only": "PermissionError",
                      "create outside": "PermissionError", "read read-only": "ok"}
    (tree / "writable" / "file.txt").write_text("again\n")
    shutil.rmtree(tree / "writable" / "sub")
    assert set(run_child(code, [], [], fenced=False).values()) == {"ok"}  # unfenced, every write works


def test_children_and_grandchildren_inherit_the_fence(tree):
    code = f'''
        secret = {str(tree / "denied" / "file.txt")!r}
        child = subprocess.run(["cat", secret], capture_output=True, text=True)
        grandchild = subprocess.run(["sh", "-c", f"{{sys.executable}} -c 'open(\\"{{secret}}\\").read()'"],
                                    capture_output=True, text=True)
        print(json.dumps({{"child": child.returncode, "child says": child.stderr.strip().split(": ")[-1],
                          "grandchild": grandchild.returncode}}))
    '''
    assert run_child(code, [], []) == {"child": 1, "child says": "Permission denied", "grandchild": 1}
    assert run_child(code, [], [], fenced=False) == {"child": 0, "child says": "", "grandchild": 0}


def test_the_command_line_restricts_then_execs(tree):
    proc = subprocess.Popen([sys.executable, "-I", str(SANDBOX), "--read", *SYSTEM, "--write", "--", "sh", "-c",
                             f"echo $$; grep NoNewPrivs /proc/self/status; cat {tree / 'denied' / 'file.txt'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    pid, no_new_privs = out.split("\n")[:2]
    assert int(pid) == proc.pid, "the command should replace the sandbox's process (exec), not run as its child"
    assert no_new_privs.split() == ["NoNewPrivs:", "1"]
    assert proc.returncode != 0 and "Permission denied" in err
    usage = subprocess.run([sys.executable, "-I", str(SANDBOX), "--read", "/usr"], capture_output=True, text=True)
    assert usage.returncode != 0 and "usage:" in usage.stderr


def test_a_fenced_command_s_shared_memory_is_its_own_and_goes_with_it(tree):
    """What a grading kernel leaves in /dev/shm is gone with it: it had a tmpfs of its own there (a mount namespace;
    an ordinary user's inside a user namespace), so the next student's kernel cannot read it."""
    name = f"course-left-behind-{os.getpid()}"
    assert sandbox.shm_can_be_private(), "this kernel refuses the namespaces: grading clears /dev/shm instead"
    out = run_child(f"""
        write("/dev/shm/{name}", "answers")
        print(json.dumps({{"wrote": os.path.exists("/dev/shm/{name}"), "shm": os.listdir("/dev/shm")}}))
        """, read=[], write=["/dev/shm"])
    assert out == {"wrote": True, "shm": [name]}, "the command sees an empty /dev/shm of its own, then its file"
    assert not os.path.exists(f"/dev/shm/{name}")


def test_where_shared_memory_cannot_be_private_what_a_grading_left_is_removed(tmp_path):
    (tmp_path / "before").write_text("someone's")
    before = set(os.listdir(tmp_path))
    (tmp_path / "left").write_text("answers")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "inside").write_text("answers")
    assert sandbox.clear_shm(before, str(tmp_path)) == ["folder", "left"]
    assert os.listdir(tmp_path) == ["before"]


def test_the_installation_includes_a_making_venv_s_packages_but_not_other_path_entries(tmp_path, monkeypatch):
    """A venv made by a Python that is itself a venv (rocm/primus's /opt/venv, which holds torch) sees its maker's
    site-packages through a .pth: the fence lets the grading process read it, or torch's dependencies fail to load
    there. A path entry that is no site-packages (an editable install's source tree) is not added."""
    maker = tmp_path / "opt-venv" / "lib" / "python3.12" / "site-packages"
    source = tmp_path / "course"
    maker.mkdir(parents=True)
    source.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(maker), str(source)])
    read = sandbox.installation(str(tmp_path / "editions"))
    assert str(maker) in read and str(source) not in read
    assert os.path.realpath(sys.prefix) in read


def test_handled_rights_follow_the_kernels_abi():
    assert sandbox.handled_rights(1) == (1 << 13) - 1
    assert sandbox.handled_rights(2) & sandbox.REFER and not sandbox.handled_rights(2) & sandbox.TRUNCATE
    assert sandbox.handled_rights(4) & sandbox.TRUNCATE and not sandbox.handled_rights(4) & sandbox.IOCTL_DEV
    assert sandbox.handled_rights(7) == (1 << 16) - 1


def test_without_landlock_grading_refuses_unless_told_to_run_unfenced(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)  # a kernel without Landlock (this one has it)
    monkeypatch.delenv(sandbox.UNSANDBOXED, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable,
                       match=r"Linux >= 5\.13 with Landlock enabled.*COURSE_GRADE_UNSANDBOXED=1"):
        sandbox.restrict(["/usr"], [])
    monkeypatch.setenv(sandbox.UNSANDBOXED, "1")
    sandbox.restrict(["/usr"], [])  # returns: this process stays unfenced
    assert "UNSANDBOXED" in capsys.readouterr().err and os.access(ROOT / "course_lib" / "parallel" / "ddp.py", os.R_OK)


# ---------------------------------------------------------------- the grading kernel

PROBE = textwrap.dedent('''
    import json, os, sqlite3, subprocess
    from pathlib import Path
    import course_lib, course_lib.parallel.ddp
    import torch
    import torch.distributed as dist
    from course_lib.launch import run_forked
    def attempt(fn):
        try:
            fn()
            return "ok"
        except Exception as err:
            return type(err).__name__
    def summed():  # what a graded exercise's measurement does: ranks over gloo, from the kernel
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t.item()
    try:
        ranks = run_forked(summed, 2, timeout=60)
    except Exception as err:
        ranks = repr(err)
    course, repo = Path("../../..").resolve(), Path(REPO)
    print(json.dumps({
        "course_lib": course_lib.__file__,
        "solutions": attempt(lambda: (course / "solutions" / "a" / "a.ipynb").read_text()),
        "source": attempt(lambda: (course / "source" / "a" / "a.ipynb").read_text()),
        "gradebook read": attempt(lambda: (course / "gradebook.db").read_bytes()),
        "gradebook sqlite": attempt(lambda: sqlite3.connect(f"file:{course}/gradebook.db?mode=rw", uri=True)
                                    .execute("UPDATE grade SET score = 100").connection.commit()),
        "other student": attempt(lambda: (course / "submitted" / "bob" / "a" / "a.ipynb").read_text()),
        "other autograded": attempt(lambda: (course / "autograded" / "bob" / "a" / "a.ipynb").read_text()),
        "instructor course_lib": attempt(lambda: (repo / "course_lib" / "parallel" / "ddp.py").read_text()),
        "instructor tests": attempt(lambda: (repo / "tests" / "conftest.py").read_text()),
        "instructor solutions": attempt(lambda: next((repo / "solutions").iterdir())),
        "child reads solutions": subprocess.run(["cat", str(course / "solutions" / "a" / "a.ipynb")]).returncode,
        "own notebook": attempt(lambda: Path("a.ipynb").read_text()),
        "write own folder": attempt(lambda: Path("written.txt").write_text("x")),
        "write home": attempt(lambda: (Path.home() / "h.txt").write_text("x")),
        "home": str(Path.home()), "run dir": os.environ["COURSE_RUN_DIR"],
        "ops": os.environ["TORCH_EXTENSIONS_DIR"], "ranks": ranks,
    }))
''')


@pytest.fixture
def course(tmp_path) -> Path:
    """A grader's course folder with the grading config, and alice's submission in autograded/ (where it runs)."""
    course = tmp_path / "course"
    course.mkdir()
    shutil.copy(ROOT / "nbgrader_config.py", course / "nbgrader_config.py")
    for folder in ("solutions/a", "source/a", "submitted/bob/a", "autograded/bob/a", "autograded/alice/a"):
        (course / folder).mkdir(parents=True)
        (course / folder / "a.ipynb").write_text('{"the answer": 42}')
    with sqlite3.connect(course / "gradebook.db") as db:
        db.execute("CREATE TABLE grade (student TEXT, score REAL)")
        db.execute("INSERT INTO grade VALUES ('bob', 1.0)")
    return course


def test_grading_kernel_reads_only_the_student_edition_and_its_submission_and_starts_ranks(course):
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    execute = next(p for p in config.Autograde.autograde_preprocessors if p.__name__ == "SandboxedExecute")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"REPO = {str(ROOT)!r}\n" + PROBE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    here = course / "autograded" / "alice" / "a"
    execute(config=config).preprocess(nb, {"metadata": {"path": str(here)}})
    printed = [o for o in nb.cells[0].outputs if o.get("name") == "stdout"]  # cat's stderr may come before or after
    assert printed, nb.cells[0].outputs
    got = json.loads(printed[-1]["text"].strip().splitlines()[-1])

    assert Path(got["course_lib"]).is_relative_to(for_grading()), "the kernel imported the instructor's course_lib"
    denied = ["solutions", "source", "gradebook read", "gradebook sqlite", "other student", "other autograded",
              "instructor course_lib", "instructor tests", "instructor solutions"]
    assert {k: got[k] for k in denied if got[k] not in ("PermissionError", "OperationalError")} == {}
    assert got["child reads solutions"] != 0
    assert {k: got[k] for k in ("own notebook", "write own folder", "write home")} == dict.fromkeys(
        ("own notebook", "write own folder", "write home"), "ok")
    assert (here / "written.txt").exists()
    assert got["ranks"] == [3.0, 3.0], f"two gloo ranks started in the grading kernel: {got['ranks']}"
    scratch = Path(got["home"])
    assert Path(got["run dir"]).parent == scratch and Path(got["ops"]).parent == scratch
    assert not scratch.exists(), "the kernel's scratch folder outlived it"
