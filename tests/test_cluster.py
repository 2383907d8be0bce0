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
    text = cluster.torchrun_sbatch(["-m", "course_lib.workers", "course_lib.parallel.deepspeed_engine:train",
                                    "/shared/run 1"], nodes=4, partition="mi300x", time="2-00:00:00", job_name="zero3")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=mi300x", "#SBATCH --time=2-00:00:00", "#SBATCH --job-name=zero3",
                 "#SBATCH --cpus-per-task=96"):
        assert line in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert re.search(r"torchrun --nnodes=4 --nproc-per-node=8 \\\n\s+--rdzv-backend=c10d "
                     r"--rdzv-endpoint=\"\$head_node:29500\" --rdzv-id=\"\$SLURM_JOB_ID\"", text)
    assert "-m course_lib.workers course_lib.parallel.deepspeed_engine:train '/shared/run 1'" in text, \
        "arguments are shell-quoted"
    assert "numa_balancing" in text, "seed 001's NUMA check"
    assert "{{" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_deepspeed_sbatch_renders_hostfile_form():
    text = cluster.deepspeed_sbatch(["-m", "course_lib.workers", "x:y"], nodes=2, gpus_per_node=8)
    assert 'deepspeed --hostfile "$hostfile" --num_nodes 2 --num_gpus 8' in text
    assert "--module course_lib.workers x:y" in text
    assert "slots=8" in text and "{{" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


@pytest.mark.parametrize("kw,message", [
    ({"nodes": 0}, "nodes=0"), ({"nodes": -2}, "nodes=-2"), ({"nodes": 1.5}, "nodes=1.5"), ({"nodes": True}, "nodes"),
    ({"gpus_per_node": 0}, "gpus_per_node=0"), ({"time": "1h"}, "time='1h'"), ({"time": "25:00:00:00"}, "time="),
    ({"partition": "gpu; rm -rf /"}, "partition="), ({"partition": ""}, "partition="),
    ({"port": 80}, "port=80"), ({"job_name": "a b"}, "job_name="), ({"cpus_per_task": -1}, "cpus_per_task"),
    ({"command": []}, "command="), ({"command": "train.py"}, "command="), ({"command": ["-m"]}, "'-m' must"),
    ({"command": ["--nproc-per-node=8", "train.py"]}, "must start with a script"),
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

def report():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "master": os.environ["MASTER_ADDR"], "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
'''


def test_torchrun_sbatch_runs_real_torchrun_ranks_through_the_rendezvous(tmp_path):
    """The generated script itself, run by bash on one 'node' with 2 CPU ranks: srun and scontrol are
    stand-ins, torchrun and course_lib.workers are real, and the ranks meet at the c10d rendezvous."""
    stubs = tmp_path / "stubs"
    _stub(stubs, "srun", STUB_SRUN)
    _stub(stubs, "scontrol", STUB_SCONTROL)
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "kwargs.json").write_text("{}")
    port = free_port()
    script = cluster.torchrun_sbatch(["-m", "course_lib.workers", "probe:report", str(out)], nodes=1,
                                     gpus_per_node=2, port=port, partition="debug", time="5")
    (tmp_path / "job.sbatch").write_text(script)
    env = _slurm_env(tmp_path, ["localhost"], stubs)
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["local_world"] == 2 for r in results)
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
