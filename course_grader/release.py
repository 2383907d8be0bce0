"""Regenerate the student notebooks (``notebooks/``) from the instructor's ``solutions/``.

    python -m course_grader.release          # rewrite notebooks/ from solutions/
    python -m course_grader.release --check  # exit 1 if notebooks/ is out of date

It runs nbgrader's own ``generate_assignment`` (solutions removed, hidden tests stripped,
outputs cleared) in a scratch copy of the course, so the project's gradebook is untouched,
then copies ``release/<id>/<id>.ipynb`` to ``notebooks/<id>.ipynb``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # course_grader/ -> the repository


def assignments(root: Path = ROOT) -> list[str]:
    """Assignment ids: the folders of ``solutions/`` that hold a notebook of the same name."""
    return sorted(p.name for p in (root / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())


def make_course(dest: Path, root: Path = ROOT, drop_tags: tuple[str, ...] = (),
                only: tuple[str, ...] | None = None) -> Path:
    """A scratch nbgrader course at ``dest``: the config, the solutions, and their generated release.

    ``drop_tags=("demo",)`` leaves out the cells tagged so (long demonstrations, not exercises):
    an exercise-only course that grades in a fraction of the time. ``only`` keeps those assignments alone.
    """
    check_cell_ids(root)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "nbgrader_config.py", dest / "nbgrader_config.py")
    for aid in (a for a in assignments(root) if only is None or a in only):
        shutil.copytree(root / "solutions" / aid, dest / "solutions" / aid, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for nb_path in (dest / "solutions").glob("*/*.ipynb") if drop_tags else ():
        nb = json.loads(nb_path.read_text())
        nb["cells"] = [c for c in nb["cells"] if not set(drop_tags) & set(c.get("metadata", {}).get("tags", []))]
        nb_path.write_text(json.dumps(nb, indent=1))
    # one nbgrader process for every assignment copied (the id is a glob): each process spends seconds importing
    nbgrader(dest, "generate_assignment", "*", "--force")
    return dest


def check_cell_ids(root: Path = ROOT) -> None:
    """Refuse solutions whose cells lack an ``id`` or share one: nbgrader gives such a cell a random id on every
    release, so ``notebooks/`` would never match ``solutions/`` (and nbgrader would tell students' cells apart
    by something that changes)."""
    for path in sorted((root / "solutions").glob("*/*.ipynb")):
        ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]
        missing = [i for i, cid in enumerate(ids) if not cid]
        repeated = sorted({cid for cid in ids if cid and ids.count(cid) > 1})
        if missing or repeated:
            raise ValueError(f"{path.relative_to(root)}: " + (f"cells {missing} have no id" if missing else "")
                             + ("; " if missing and repeated else "") + (f"ids {repeated} repeat" if repeated else "")
                             + ": give each cell a unique \"id\" (8 letters or digits, any), or nbgrader invents one "
                             "on every release")


def nbgrader(course: Path, *args: str, env: dict | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run an nbgrader command in a course folder; raise with its output if it fails."""
    cmd = [sys.executable, "-m", "nbgrader", *args]
    env = {**os.environ, **(env or {})}
    # nbgrader runs `alembic` by name: the environment's own bin folder must be on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(cmd, cwd=course, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed in {course}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def released(course: Path) -> dict[str, dict]:
    """The generated student notebooks of a scratch course, as parsed JSON by assignment id."""
    return {aid: json.loads((course / "release" / aid / f"{aid}.ipynb").read_text()) for aid in assignments(course)}


def main(argv: list[str] | None = None) -> int:
    """``python -m course_grader.release``: regenerate ``notebooks/`` from ``solutions/``; with ``--check``, exit 1
    if they differ."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether notebooks/ is in sync")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = released(make_course(Path(tmp) / "course"))
        stale = []
        for aid, nb in fresh.items():
            target = ROOT / "notebooks" / f"{aid}.ipynb"
            current = json.loads(target.read_text()) if target.exists() else None
            if current != nb:
                stale.append(target.name)
                if not args.check:
                    target.parent.mkdir(exist_ok=True)
                    shutil.copy(Path(tmp) / "course" / "release" / aid / f"{aid}.ipynb", target)
        extra = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb") if p.stem not in fresh)
    if args.check:
        if stale or extra:
            print(f"notebooks/ is out of date: {stale + extra}; run python -m course_grader.release")
            return 1
        print("notebooks/ is in sync with solutions/")
        return 0
    print(f"regenerated: {stale or 'nothing (already in sync)'}")
    if extra:
        print(f"notebooks/ also holds {extra}, which solutions/ does not: remove them if they are stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
