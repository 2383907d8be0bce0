"""SLURM launch scripts for the course's training beyond one machine (for example 8×MI300X nodes).

Two forms, rendered from ``course_lib/apps/templates/``:

- ``torchrun``: ``sbatch`` with one task per node; each task runs ``torchrun`` with the c10d
  rendezvous at the first node of the allocation (its name from ``scontrol show hostnames``),
  ``--nproc-per-node`` ranks per node, and the job id as the rendezvous id.
- ``deepspeed``: ``sbatch`` that writes a DeepSpeed hostfile from ``SLURM_JOB_NODELIST``
  (``<node> slots=<gpus>`` per line) and runs ``deepspeed --hostfile ... --num_gpus <gpus>``
  on the first node, which reaches the others over ssh (pdsh).

    python -m course_lib.apps.cluster torchrun --nodes 2 --partition mi300x --time 02:00:00 \\
        --kwargs '{"spec": {"steps": 20, "stage": 3}}' \\
        -- -m course_lib.workers course_lib.parallel.zero_deepspeed:train /shared/run1
    python -m course_lib.apps.cluster deepspeed --nodes 4 -- train.py --deepspeed ds_config.json

The command after ``--`` is a script and its arguments, or ``-m module`` and its arguments
(``deepspeed`` gets ``--module module``). A ``course_lib.workers`` command reads its function's keyword
arguments from ``OUT_DIR/kwargs.json``: the script writes ``--kwargs`` there (``{}``, the defaults, without it).
Each rank is bound to the CPUs near its GPU where the nodes have GPUs and ``numactl``. Nothing here talks to a
cluster: the scripts are text that ``sbatch`` takes; see docs/workshop.md, "Workshop: Docker images and clusters".
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

FORMS = ("torchrun", "deepspeed")
_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}(:\d{2})?)?|\d+(:\d{2}(:\d{2})?)?)$")  # sbatch --time formats
_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")  # partition (comma-separated list allowed) and job names
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class Job:
    """What one multi-node training job needs: its size, its command, and where SLURM runs it."""

    command: tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str = "gpu"
    time: str = "01:00:00"
    job_name: str = "course"
    cpus_per_task: int = 0  # 0: 12 per GPU (an MI300X node has 8 GPUs and 96+ cores per socket pair)
    port: int = 29500
    kwargs: str = ""  # a course_lib.workers function's keyword arguments, as a JSON object

    def __post_init__(self):
        validate(self)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(job: Job) -> None:
    """Raise ``ValueError`` naming the bad parameter and what it must be."""
    if not _is_int(job.nodes) or job.nodes < 1:
        raise ValueError(f"nodes={job.nodes!r}: must be an integer >= 1")
    if not _is_int(job.gpus_per_node) or not 1 <= job.gpus_per_node <= 64:
        raise ValueError(f"gpus_per_node={job.gpus_per_node!r}: must be an integer from 1 to 64 "
                         f"(an MI300X node has 8)")
    if not _is_int(job.cpus_per_task) or job.cpus_per_task < 0:
        raise ValueError(f"cpus_per_task={job.cpus_per_task!r}: must be an integer >= 0 (0 picks 12 per GPU)")
    if not _is_int(job.port) or not 1024 <= job.port <= 65535:
        raise ValueError(f"port={job.port!r}: must be an integer from 1024 to 65535")
    if not isinstance(job.partition, str) or not _NAME.match(job.partition):
        raise ValueError(f"partition={job.partition!r}: must be a SLURM partition name "
                         f"(letters, digits, '_', '-', '.', commas between several)")
    if not isinstance(job.job_name, str) or not _NAME.match(job.job_name):
        raise ValueError(f"job_name={job.job_name!r}: use letters, digits, '_', '-', '.' only")
    if not isinstance(job.time, str) or not _TIME.match(job.time):
        raise ValueError(f"time={job.time!r}: must be a SLURM time limit such as 30, 01:30:00 or 2-00:00:00 "
                         f"(minutes, [HH:]MM:SS, or D-HH[:MM[:SS]])")
    cmd = job.command
    if isinstance(cmd, str) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"command={cmd!r}: must be a non-empty list of strings: a script and its arguments, "
                         f"or '-m', a module and its arguments")
    if cmd[0] == "-m":
        if len(cmd) < 2 or not _MODULE.match(cmd[1]):
            raise ValueError(f"command={list(cmd)!r}: '-m' must be followed by a module name, "
                             f"e.g. -m course_lib.workers")
    elif cmd[0].startswith("-"):
        raise ValueError(f"command={list(cmd)!r}: must start with a script (train.py) or '-m module', "
                         f"not the option {cmd[0]!r}")
    _validate_worker(job)


def _is_worker(job: Job) -> bool:
    """Whether ``job`` runs a ``course_lib.workers`` function (``-m course_lib.workers MODULE:FUNCTION OUT_DIR``)."""
    return tuple(job.command[:2]) == ("-m", "course_lib.workers")


def _validate_worker(job: Job) -> None:
    """A ``course_lib.workers`` command names ``MODULE:FUNCTION OUT_DIR``; ``kwargs`` is a JSON object, and only
    such a command reads it."""
    cmd, worker = job.command, _is_worker(job)
    if worker and (len(cmd) != 4 or ":" not in cmd[2]):
        raise ValueError(f"command={list(cmd)!r}: course_lib.workers takes MODULE:FUNCTION OUT_DIR, e.g. -m "
                         "course_lib.workers course_lib.parallel.zero_deepspeed:train /shared/run1")
    if not isinstance(job.kwargs, str):
        raise ValueError(f"kwargs={job.kwargs!r}: must be a JSON object as text, e.g. '{{\"steps\": 20}}'")
    if job.kwargs:
        try:
            parsed = json.loads(job.kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"kwargs={job.kwargs!r}: not JSON ({err})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"kwargs={job.kwargs!r}: must be a JSON object of keyword arguments, e.g. "
                             "'{\"steps\": 20}'")
        if not worker:
            raise ValueError("kwargs is for a course_lib.workers command (-m course_lib.workers MODULE:FUNCTION "
                             f"OUT_DIR); pass {list(job.command)[:1]} its arguments after '--' instead")


def _prepare(job: Job) -> str:
    """The script's lines that write a course_lib.workers function's keyword arguments where its ranks read them."""
    if not _is_worker(job):
        return "# (no course_lib.workers command: nothing to prepare)"
    out = shlex.quote(job.command[3])
    kwargs = json.dumps(json.loads(job.kwargs or "{}"), sort_keys=True)
    return (f"# course_lib.workers reads its function's keyword arguments from OUT_DIR/kwargs.json (a shared folder)\n"
            f"mkdir -p {out} && printf '%s\\n' {shlex.quote(kwargs)} > {out}/kwargs.json")


def _cpus(job: Job) -> int:
    return job.cpus_per_task or 12 * job.gpus_per_node


def _command(job: Job, form: str) -> str:
    cmd = list(job.command)
    if form == "deepspeed" and cmd[0] == "-m":
        cmd = ["--module", *cmd[1:]]
    return shlex.join(cmd)


def template(form: str) -> str:
    """The raw template text of a form ('torchrun' or 'deepspeed')."""
    if form not in FORMS:
        raise ValueError(f"form={form!r}: must be one of {FORMS}")
    return resources.files("course_lib.apps").joinpath("templates", f"{form}.sbatch").read_text()


def render(form: str, job: Job) -> str:
    """The sbatch script of ``form`` for ``job``; every placeholder of the template filled."""
    values = {
        "nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "partition": job.partition,
        "time": job.time, "job_name": job.job_name, "cpus_per_task": _cpus(job), "port": job.port,
        "command": _command(job, form), "prepare": _prepare(job),
    }
    text = template(form)
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if missing:  # a template edited with a name this module does not know
        raise KeyError(f"template {form}.sbatch uses unknown placeholders {missing}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def _as_command(command) -> tuple:
    if isinstance(command, str):  # a string would be taken apart letter by letter
        raise ValueError(f"command={command!r}: must be a list of strings, e.g. ['train.py', '--epochs', '1'] "
                         f"(shlex.split a command line)")
    return tuple(command)


def torchrun_sbatch(command, **job) -> str:
    """sbatch script: one torchrun per node, c10d rendezvous at the allocation's first node.

    ``job`` takes the fields of ``Job`` (nodes, gpus_per_node, partition, time, ...), with its defaults.
    """
    return render("torchrun", Job(_as_command(command), **job))


def deepspeed_sbatch(command, **job) -> str:
    """sbatch script: hostfile from SLURM_JOB_NODELIST, then ``deepspeed --hostfile ... --num_gpus``.

    ``job`` takes the fields of ``Job`` (nodes, gpus_per_node, partition, time, ...), with its defaults.
    """
    return render("deepspeed", Job(_as_command(command), **job))


def hostfile(nodelist: list[str], gpus_per_node: int = 8) -> str:
    """The DeepSpeed hostfile for expanded node names (what the deepspeed template writes at run time)."""
    if not nodelist or not all(isinstance(n, str) and n.strip() and " " not in n for n in nodelist):
        raise ValueError(f"nodelist={nodelist!r}: must be a non-empty list of host names")
    if not _is_int(gpus_per_node) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r}: must be an integer >= 1")
    return "".join(f"{n} slots={gpus_per_node}\n" for n in nodelist)


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.apps.cluster FORM [options] -- COMMAND``: print (or ``-o`` write) the sbatch script of
    a form."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.apps.cluster", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s {torchrun,deepspeed} [options] -- SCRIPT [ARGS...] | -- -m MODULE [ARGS...]")
    parser.add_argument("form", choices=FORMS)
    defaults = {f.name: f.default for f in fields(Job) if f.name != "command"}  # Job states them once
    helps = {"kwargs": "a course_lib.workers function's keyword arguments, a JSON object: the script writes them "
                       "to OUT_DIR/kwargs.json"}
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            help=helps.get(name))
    parser.add_argument("-o", "--output", type=Path, help="write the script here instead of printing it")
    args = parser.parse_args(argv)
    if not command:
        parser.error("give the training command after '--', e.g. -- train.py --epochs 1")
    try:
        job = Job(tuple(command), **{name: getattr(args, name) for name in defaults})
    except ValueError as err:
        parser.error(str(err))
    text = render(args.form, job)
    if args.output:
        args.output.write_text(text)
        args.output.chmod(0o755)
        print(f"wrote {args.output}: submit it with `sbatch {args.output}`", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
