"""course_lib.apps.cluster's SLURM scripts, tested without a SLURM cluster.

The scripts are rendered, checked by bash, and run with stand-ins for srun and scontrol: the
torchrun form starts real torchrun ranks that meet at the c10d rendezvous and all-reduce; the
DeepSpeed form writes a hostfile that DeepSpeed's own parser reads. Bad parameters are refused
with a message naming them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.apps import cluster
from course_lib.distributed import free_port

BIN = Path(sys.executable).parent


def _stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/usr/bin/env bash\n" + body)
    (folder / name).chmod(0o755)


def _slurm_env(tmp: Path, nodes: list[str], stubs: Path) -> dict:
    return {**os.environ, "PATH": f"{stubs}:{BIN}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NNODES": str(len(nodes)), "SLURM_CPUS_PER_TASK": "4",
            "SLURM_SUBMIT_DIR": str(tmp), "FAKE_NODES": "\n".join(nodes)}


STUB_SRUN = 'while [[ "${1:-}" == -* ]]; do shift; done\necho "srun $*" >> "$SLURM_SUBMIT_DIR/calls"\nexec "$@"\n'
STUB_SCONTROL = '[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "%s\\n" "$FAKE_NODES"\n'


def test_torchrun_sbatch_renders_the_sbatch_header_and_rendezvous():
    text = cluster.torchrun_sbatch(["-m", "course_lib.workers", "course_lib.parallel.zero_deepspeed:train",
                                    "/shared/run 1"], nodes=4, partition="mi300x", time="2-00:00:00", job_name="zero3")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=mi300x", "#SBATCH --time=2-00:00:00", "#SBATCH --job-name=zero3",
                 "#SBATCH --cpus-per-task=96"):
        assert line in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert re.search(r"torchrun --nnodes=4 --nproc-per-node=8 \\\n\s+--rdzv-backend=c10d "
                     r"--rdzv-endpoint=\"\$head_node:29500\" --rdzv-id=\"\$SLURM_JOB_ID\"", text)
    assert "-m course_lib.workers course_lib.parallel.zero_deepspeed:train '/shared/run 1'" in text, \
        "arguments are shell-quoted"
    assert "numa_balancing" in text, "seed 001's NUMA check"
    assert "{{" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_deepspeed_sbatch_renders_hostfile_form():
    text = cluster.deepspeed_sbatch(["-m", "course_lib.workers", "x:y", "/shared/run1"], nodes=2, gpus_per_node=8)
    assert 'deepspeed --hostfile "$hostfile" --num_nodes 2 --num_gpus 8' in text
    assert "--module course_lib.workers x:y /shared/run1" in text
    assert "printf '%s\\n' '{}' > /shared/run1/kwargs.json" in text, "no --kwargs: the function's defaults"
    assert "slots=8" in text and "{{" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


@pytest.mark.parametrize("kw,message", [
    ({"nodes": 0}, "nodes=0"), ({"nodes": -2}, "nodes=-2"), ({"nodes": 1.5}, "nodes=1.5"), ({"nodes": True}, "nodes"),
    ({"gpus_per_node": 0}, "gpus_per_node=0"), ({"time": "1h"}, "time='1h'"), ({"time": "25:00:00:00"}, "time="),
    ({"partition": "gpu; rm -rf /"}, "partition="), ({"partition": ""}, "partition="),
    ({"port": 80}, "port=80"), ({"job_name": "a b"}, "job_name="), ({"cpus_per_task": -1}, "cpus_per_task"),
    ({"command": []}, "command="), ({"command": "train.py"}, "command="), ({"command": ["-m"]}, "'-m' must"),
    ({"command": ["--nproc-per-node=8", "train.py"]}, "must start with a script"),
    ({"command": ["-m", "course_lib.workers", "x:y"]}, "MODULE:FUNCTION OUT_DIR"),
    ({"command": ["-m", "course_lib.workers", "x", "/out"]}, "MODULE:FUNCTION OUT_DIR"),
    ({"command": ["-m", "course_lib.workers", "x:y", "/out"], "kwargs": "{steps: 2}"}, "not JSON"),
    ({"command": ["-m", "course_lib.workers", "x:y", "/out"], "kwargs": "[2]"}, "JSON object"),
    ({"kwargs": '{"steps": 2}'}, "kwargs is for a course_lib.workers command"),
])
def test_bad_parameters_are_refused_with_a_clear_message(kw, message):
    args = {"command": ["train.py"], **kw}
    with pytest.raises(ValueError, match=re.escape(message)):
        cluster.torchrun_sbatch(**args)
    with pytest.raises(ValueError, match=re.escape(message)):
        cluster.deepspeed_sbatch(**args)


def test_cli_prints_and_writes_scripts(tmp_path):
    py = [sys.executable, "-m", "course_lib.apps.cluster"]
    out = subprocess.run([*py, "torchrun", "--nodes", "2", "--partition", "mi300x", "--", "train.py", "--lr", "1e-4"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "#SBATCH --nodes=2" in out and "train.py --lr 1e-4" in out
    subprocess.run([*py, "deepspeed", "-o", str(tmp_path / "job.sbatch"), "--", "train.py"], check=True, timeout=60)
    assert "deepspeed --hostfile" in (tmp_path / "job.sbatch").read_text()
    bad = subprocess.run([*py, "torchrun", "--nodes", "0", "--", "train.py"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "nodes=0: must be an integer >= 1" in bad.stderr
    bad = subprocess.run([*py, "torchrun", "--nodes", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "after '--'" in bad.stderr


PROBE = '''
import os
import torch
import torch.distributed as dist

def report(scale=1.0):
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "master": os.environ["MASTER_ADDR"], "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
'''


def test_torchrun_sbatch_runs_real_torchrun_ranks_through_the_rendezvous(tmp_path):
    """The generated script itself, run by bash on one 'node' with 2 CPU ranks: srun and scontrol are
    stand-ins, torchrun and course_lib.workers are real, and the ranks meet at the c10d rendezvous. The worker's
    keyword arguments reach it through the OUT_DIR/kwargs.json the script writes (OUT_DIR not made beforehand)."""
    stubs = tmp_path / "stubs"
    _stub(stubs, "srun", STUB_SRUN)
    _stub(stubs, "scontrol", STUB_SCONTROL)
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "run 1"
    port = free_port()
    script = cluster.torchrun_sbatch(["-m", "course_lib.workers", "probe:report", str(out)], nodes=1,
                                     gpus_per_node=2, port=port, partition="debug", time="5", kwargs='{"scale": 2}')
    (tmp_path / "job.sbatch").write_text(script)
    env = _slurm_env(tmp_path, ["localhost"], stubs)
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 6.0 and r["local_world"] == 2 for r in results), results
    assert all(r["master"] == "localhost" for r in results)
    calls = (tmp_path / "calls").read_text()
    assert f"--rdzv-endpoint=localhost:{port}" in calls and "--rdzv-id=4242" in calls


def test_deepspeed_sbatch_writes_a_hostfile_deepspeed_reads(tmp_path):
    """The generated script with three fake nodes: the hostfile it writes is parsed by DeepSpeed's own
    launcher code, and the launcher's own argument parser accepts the command it runs."""
    stubs = tmp_path / "stubs"
    _stub(stubs, "srun", STUB_SRUN)
    _stub(stubs, "scontrol", STUB_SCONTROL)
    _stub(stubs, "deepspeed", 'printf "%s\\n" "$@" > "$SLURM_SUBMIT_DIR/deepspeed_args"\n')
    script = cluster.deepspeed_sbatch(["train.py", "--deepspeed", "ds_config.json"], nodes=3, gpus_per_node=8,
                                      port=29611)
    (tmp_path / "job.sbatch").write_text(script)
    env = _slurm_env(tmp_path, ["mi300x-001", "mi300x-002", "mi300x-017"], stubs)
    env["NCCL_SOCKET_IFNAME"] = "ens50f0np0"
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hostfile = tmp_path / "hostfile-4242"
    assert hostfile.read_text() == cluster.hostfile(["mi300x-001", "mi300x-002", "mi300x-017"], 8)
    args = (tmp_path / "deepspeed_args").read_text().splitlines()
    assert args[:2] == ["--hostfile", str(hostfile)]
    assert "NCCL_SOCKET_IFNAME=ens50f0np0" in (tmp_path / "deepspeed_env-4242").read_text(), \
        "the job's RCCL settings reach the other nodes through DS_ENV_FILE"
    check = subprocess.run([sys.executable, "-c", (
        "import json, sys\n"
        "from deepspeed.launcher.runner import fetch_hostfile, parse_args\n"
        "a = parse_args(sys.argv[1:])\n"
        "print(json.dumps({'hosts': dict(fetch_hostfile(a.hostfile)), 'nodes': a.num_nodes, 'gpus': a.num_gpus,"
        " 'addr': a.master_addr, 'port': a.master_port, 'script': a.user_script, 'args': a.user_args}))"),
        *args], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    assert got == {"hosts": {"mi300x-001": 8, "mi300x-002": 8, "mi300x-017": 8}, "nodes": 3, "gpus": 8,
                   "addr": "mi300x-001", "port": 29611, "script": "train.py", "args": ["--deepspeed", "ds_config.json"]}


def test_hostfile_refuses_bad_input():
    assert cluster.hostfile(["a", "b"], 4) == "a slots=4\nb slots=4\n"
    for bad in ([], [""], ["a b"]):
        with pytest.raises(ValueError, match="nodelist"):
            cluster.hostfile(bad)
    with pytest.raises(ValueError, match="gpus_per_node"):
        cluster.hostfile(["a"], 0)


def _numa_run(tmp_path: Path, form: str, gpus_on_node: str | None) -> list[str]:
    """The launcher's arguments when the script runs with stand-in launchers and numactl, on a node with
    ``gpus_on_node`` GPUs (SLURM_GPUS_ON_NODE; None: SLURM set none, a CPU node)."""
    stubs = tmp_path / "stubs"
    for name, body in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("numactl", "exit 0\n"),
                       ("torchrun", '[ "$1" = --help ] && { echo "  --numa-binding {node,socket}"; exit 0; }\n'
                                    'printf "%s\\n" "$@" > "$SLURM_SUBMIT_DIR/launcher_args"\n'),
                       ("deepspeed", 'printf "%s\\n" "$@" > "$SLURM_SUBMIT_DIR/launcher_args"\n')):
        _stub(stubs, name, body)
    render = cluster.torchrun_sbatch if form == "torchrun" else cluster.deepspeed_sbatch
    (tmp_path / "job.sbatch").write_text(render(["train.py"], nodes=1, gpus_per_node=8))
    env = _slurm_env(tmp_path, ["mi300x-001"], stubs)
    env.pop("SLURM_GPUS_ON_NODE", None)
    env.update({"SLURM_GPUS_ON_NODE": gpus_on_node} if gpus_on_node else {})
    env["PYTORCH_HIP_ALLOC_CONF"] = "expandable_segments:True"
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (tmp_path / "launcher_args").read_text().splitlines()


@pytest.mark.parametrize("form, flag", [("torchrun", "--numa-binding=node"), ("deepspeed", "--bind_cores_to_rank")])
@pytest.mark.parametrize("gpus_on_node", ["8", None])
def test_ranks_are_bound_to_their_numa_node_where_the_node_has_gpus_and_numactl(tmp_path, form, flag, gpus_on_node):
    """CPU Adam, offload's copies and the data loader run on a rank's CPU cores: bound near its GPU, they stay on
    one socket. A CPU node (no GPUs for torch to place) is left unbound."""
    args = _numa_run(tmp_path, form, gpus_on_node)
    assert (flag in args) == (gpus_on_node is not None), args
    assert args[-1] == "train.py"
    if form == "deepspeed":
        check = subprocess.run([sys.executable, "-c", "import sys\nfrom deepspeed.launcher.runner import parse_args\n"
                                "a = parse_args(sys.argv[1:]); print(a.bind_cores_to_rank, a.user_script)", *args],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stderr[-2000:]
        assert check.stdout.split()[-2:] == [str(gpus_on_node is not None), "train.py"]
        assert "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True" in (tmp_path / "deepspeed_env-4242").read_text(), \
            "the allocator's settings reach the other nodes' ranks"


def test_a_worker_without_its_kwargs_file_says_how_to_write_one(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "course_lib.workers", "json:dumps", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    error = (tmp_path / "rank0.error").read_text()
    assert "kwargs.json" in error and "--kwargs" in error, error[-2000:]
