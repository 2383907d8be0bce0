"""JupyterHub for a whole class: each student's JupyterLab with the course, nbgrader's Formgrader for the instructors.

    COURSE_HUB_SPAWNER=docker  one GPU node: each user's lab in the workshop image (docker/README.md), a GPU share each
    COURSE_HUB_SPAWNER=slurm   a cluster: each user's lab is a SLURM job on a GPU partition (batchspawner)
    COURSE_HUB_SPAWNER=local   a plain process per user, no isolation: only for tests/test_hub.py

Start it with docker/hub/start.sh (docker/hub/README.md). Everything below is a plain value that an
environment variable of the same meaning overrides. The users file lists the class, one `name role` a line
(role: student or instructor). Student ids in nbgrader are the hub user names.
"""

import os
import socket
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub provides it)

HERE = Path(__file__).resolve().parent
COURSE_DIR = Path(os.environ.get("COURSE_DIR", HERE.parent.parent))  # the checkout (with .venv) the hub runs from
MODE = os.environ.get("COURSE_HUB_SPAWNER", "docker")
STATE = Path(os.environ.get("COURSE_HUB_STATE", "/srv/jupyterhub"))  # users file, GPU map; start.sh runs the hub here
USERS_FILE = Path(os.environ.get("COURSE_HUB_USERS", STATE / "users.txt"))
GPU_MAP_FILE = Path(os.environ.get("COURSE_HUB_GPU_MAP", STATE / "gpus.txt"))  # optional: `name 0,1` a line
N_GPUS = int(os.environ.get("COURSE_HUB_GPUS", "8"))  # without a map entry, user i of the users file gets GPU i % N
PLATFORM = os.environ.get("COURSE_HUB_GPU", "rocm")  # rocm or cuda: which workshop image, which device flags
IMAGE = os.environ.get("COURSE_HUB_IMAGE", f"scaling-pytorch-course:{PLATFORM}")  # as `make docker-rocm` tags it
MEM_LIMIT = os.environ.get("COURSE_HUB_MEM_LIMIT", "96G")  # per user; an 8x MI300X node has 1.5-2 TB
SHM_SIZE = "64G"  # seed 001's --shm-size, as docker/run.sh
IDLE_TIMEOUT = int(os.environ.get("COURSE_HUB_IDLE_TIMEOUT", "3600"))  # s; the culler stops idle labs, work stays
COURSE_ID = "scaling-pytorch-training"  # the course's nbgrader_config.py; also the Formgrader service's name
EXCHANGE = os.environ.get("COURSE_HUB_EXCHANGE", "/srv/nbgrader/exchange")  # nbgrader's exchange, shared by all
GRADER_DIR = os.environ.get("COURSE_HUB_GRADER_DIR", "/srv/nbgrader/grader")  # the Formgrader's course is in course/
GRADER_PORT = int(os.environ.get("COURSE_HUB_GRADER_PORT", "9999"))
GRADER_USER = os.environ.get("COURSE_HUB_GRADER_USER", "grader")  # runs students' code when autograding: not root
START_LAB = str(COURSE_DIR / "docker" / "start-lab.sh")  # the images' entrypoint, also run by local and the grader
SLURM = dict(partition="gpu", time="01:00:00", cpus_per_gpu=12)  # course_lib.cluster.Job's defaults
assert MODE in ("docker", "slurm", "local"), f"COURSE_HUB_SPAWNER={MODE}: use docker, slurm or local"
assert PLATFORM in ("rocm", "cuda"), f"COURSE_HUB_GPU={PLATFORM}: use rocm or cuda"


def read_table(path: Path) -> dict[str, str]:
    """`name value` lines (# comments) → {name: value}, in file order."""
    rows = [line.split("#")[0].split() for line in path.read_text().splitlines()]
    return {row[0]: row[1] for row in rows if row}


# --- who is in the class -------------------------------------------------------------------------------------
ROLES = read_table(USERS_FILE)
bad = {name: role for name, role in ROLES.items() if role not in ("student", "instructor")}
assert not bad, f"{USERS_FILE}: roles must be student or instructor, not {bad}"
INSTRUCTORS = sorted(name for name, role in ROLES.items() if role == "instructor")

# FirstUseAuthenticator (JupyterHub's own): per-user passwords, bcrypt-hashed in a file next to the hub, no
# system accounts, no outside identity provider. The password a listed user types at their first login becomes
# theirs; a name not in the users file cannot log in or set one (create_users off). Instructors are admins:
# deleting a user in /hub/admin clears their password (for a forgotten one), and users change theirs at
# /hub/auth/change-password. NativeAuthenticator (sign-up page, admin approval) fails its login on
# JupyterHub 6. On a cluster the users already have accounts (SLURM runs their jobs as them): PAM.
if MODE == "slurm":
    c.JupyterHub.authenticator_class = "pam"
else:
    c.JupyterHub.authenticator_class = "firstuseauthenticator.FirstUseAuthenticator"
    c.FirstUseAuthenticator.create_users = False
    c.FirstUseAuthenticator.min_password_length = 8
    c.FirstUseAuthenticator.dbm_path = str(STATE / "passwords.dbm")
c.Authenticator.allowed_users = set(ROLES)
c.Authenticator.admin_users = set(INSTRUCTORS)

# --- nbgrader, "one class, one grader": the Formgrader is a hub service that only the instructors reach ---------
c.JupyterHub.load_groups = {
    "instructors": {"users": INSTRUCTORS},
    f"formgrade-{COURSE_ID}": {"users": INSTRUCTORS},  # add TAs here to let them grade without being admins
}
c.JupyterHub.load_roles = [
    {"name": f"formgrade-{COURSE_ID}", "groups": [f"formgrade-{COURSE_ID}"],
     "scopes": [f"access:services!service={COURSE_ID}"]},
    {"name": "idle-culler", "services": ["idle-culler"],
     "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]},
]
grader = {
    "name": COURSE_ID,
    "url": f"http://127.0.0.1:{GRADER_PORT}",
    # start-lab.sh as instructor: copies the course's nbgrader config and solutions/ into GRADER_DIR/course once
    "command": ["bash", START_LAB],
    "cwd": GRADER_DIR,
    "environment": {
        "COURSE_DIR": str(COURSE_DIR), "COURSE_ROLE": "instructor", "WORK_DIR": GRADER_DIR,
        "PORT": str(GRADER_PORT), "LAB_IP": "127.0.0.1", "NBGRADER_EXCHANGE": EXCHANGE,
        "JUPYTER_CONFIG_PATH": str(HERE / "grader"),  # loads the hub extension, lets Lab frame the Formgrader
        "JUPYTERHUB_DEFAULT_URL": "/lab",
    },
    "oauth_no_confirm": True,
}
if MODE == "local":  # the test runs as root with no system users: the grader runs as the hub's user
    grader["environment"].update(HOME=f"{GRADER_DIR}/home", COURSE_ALLOW_ROOT="1" if os.getuid() == 0 else "0")
else:
    grader["user"] = GRADER_USER
c.JupyterHub.services = [
    grader,
    {"name": "idle-culler",
     "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE_TIMEOUT}", "--cull-every=300"]},
]

# --- the hub and its proxy -----------------------------------------------------------------------------------
c.JupyterHub.bind_url = os.environ.get("COURSE_HUB_URL", "http://:8000")  # put TLS in front, or set ssl_cert/ssl_key
# from npm, into the course's .venv: npm install --prefix .venv configurable-http-proxy
proxy = COURSE_DIR / ".venv" / "node_modules" / ".bin" / "configurable-http-proxy"
c.ConfigurableHTTPProxy.command = [str(proxy) if proxy.exists() else "configurable-http-proxy"]
# the API address the labs call back to: the docker bridge for containers, this host's name for cluster nodes
HUB_IP = {"docker": "172.17.0.1", "slurm": "0.0.0.0", "local": "127.0.0.1"}[MODE]
c.JupyterHub.hub_ip = os.environ.get("COURSE_HUB_IP", HUB_IP)
if MODE == "slurm":
    c.JupyterHub.hub_connect_ip = os.environ.get("COURSE_HUB_CONNECT_IP", socket.getfqdn())
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 300  # a SLURM job may queue, a container may start cold
c.Spawner.http_timeout = 120


# --- a GPU share per user --------------------------------------------------------------------------------------
def gpus_for(username: str) -> list[int]:
    """Host GPU indices for a user: their line in the GPU map file, else round-robin by place in the users file."""
    table = read_table(GPU_MAP_FILE) if GPU_MAP_FILE.exists() else {}
    if username in table:
        return [int(g) for g in table[username].split(",")]
    return [list(ROLES).index(username) % N_GPUS]


def render_nodes(gpus: list[int]) -> list[str]:
    """/dev/dri/renderD* of ROCm GPUs by index: the GPU nodes of the KFD topology in order, as docker/run.sh --gpus."""
    topology = Path(os.environ.get("KFD_TOPOLOGY", "/sys/class/kfd/kfd/topology/nodes"))
    if not topology.is_dir():  # not a ROCm host (run.sh assumes the same)
        return [f"/dev/dri/renderD{128 + g}" for g in gpus]
    minors = []
    for node in sorted(topology.iterdir(), key=lambda p: int(p.name)):
        if (node / "gpu_id").read_text().strip() != "0":  # CPU nodes have gpu_id 0
            props = dict(line.split() for line in (node / "properties").read_text().splitlines() if line.strip())
            minors.append(props["drm_render_minor"])
    missing = [g for g in gpus if g >= len(minors)]
    assert not missing, f"GPUs {missing} asked for, but {topology} has {len(minors)} GPUs"
    return [f"/dev/dri/renderD{minors[g]}" for g in gpus]


def visible(spawner) -> str:
    """Inside the container the GPUs it was given are numbered from 0."""
    return ",".join(str(i) for i in range(len(gpus_for(spawner.user.name))))


def gpu_host_config(spawner) -> dict:
    """docker run's GPU and memory flags for this user (seed 001's for ROCm, NVIDIA's for CUDA), as docker/run.sh."""
    gpus = gpus_for(spawner.user.name)
    if PLATFORM == "rocm":
        nodes = render_nodes(gpus)
        groups = ["video"] + [str(os.stat(n).st_gid) for n in nodes[:1] if os.path.exists(n)]  # the render group
        return dict(devices=["/dev/kfd", *nodes], group_add=groups, ipc_mode="host", shm_size=SHM_SIZE,
                    cap_add=["SYS_PTRACE"], security_opt=["seccomp=unconfined"])
    return dict(device_requests=[dict(driver="nvidia", device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])],
                ipc_mode="host", shm_size=SHM_SIZE,
                ulimits=[dict(name="memlock", soft=-1, hard=-1), dict(name="stack", soft=67108864, hard=67108864)])


# --- where each user's lab runs ---------------------------------------------------------------------------------
student_env = {  # read by start-lab.sh, and by nbgrader through JUPYTER_CONFIG_PATH
    "COURSE_ROLE": "student",
    "NBGRADER_EXCHANGE": EXCHANGE,
    "JUPYTER_CONFIG_PATH": str(HERE / "student"),  # hub extension, student id = hub name, no Formgrader
}

if MODE == "docker":
    c.JupyterHub.spawner_class = "dockerspawner.DockerSpawner"
    c.DockerSpawner.image = IMAGE
    c.DockerSpawner.pull_policy = "never"  # built on this host by `make docker-rocm` / `make docker-cuda`
    c.DockerSpawner.name_template = "course-lab-{username}"
    c.DockerSpawner.remove = True  # the container goes when the lab stops; the named volume stays
    c.DockerSpawner.cmd = ["--ServerApp.default_url=/lab"]  # arguments to the entrypoint, start-lab.sh
    c.DockerSpawner.volumes = {
        "course-{username}": "/home/student/work",  # the user's notebooks, across restarts and image updates
        EXCHANGE: EXCHANGE,
        str(HERE / "student"): {"bind": str(HERE / "student"), "mode": "ro"},
    }
    c.DockerSpawner.mem_limit = MEM_LIMIT
    c.DockerSpawner.extra_host_config = gpu_host_config
    gpu_env = ["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"] if PLATFORM == "rocm" else ["CUDA_VISIBLE_DEVICES"]
    c.DockerSpawner.environment = {**student_env, **{name: visible for name in gpu_env}}

elif MODE == "slurm":
    # One job per lab, on a GPU node. The checkout is on the shared file system at the same path, as is the
    # exchange; the course .venv has jupyterhub (batchspawner-singleuser reports the lab's port to the hub).
    c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
    c.SlurmSpawner.req_partition = os.environ.get("COURSE_HUB_PARTITION", SLURM["partition"])
    c.SlurmSpawner.req_runtime = os.environ.get("COURSE_HUB_TIME", SLURM["time"])
    c.SlurmSpawner.req_gres = "gpu:1"
    c.SlurmSpawner.req_nprocs = str(SLURM["cpus_per_gpu"])
    c.SlurmSpawner.req_memory = MEM_LIMIT
    c.SlurmSpawner.req_prologue = (
        f"export PATH={COURSE_DIR}/.venv/bin:$PATH TORCH_EXTENSIONS_DIR={COURSE_DIR}/.venv/torch_extensions\n"
        f"mkdir -p ~/work && {{ [ -e ~/work/notebooks ] || cp -R {COURSE_DIR}/notebooks ~/work/; }}"
    )
    c.SlurmSpawner.cmd = [f"{COURSE_DIR}/.venv/bin/jupyterhub-singleuser"]
    c.SlurmSpawner.notebook_dir = "~/work"
    c.SlurmSpawner.environment = student_env

else:  # local: tests only. Every lab runs as the hub's user, in a home under COURSE_HUB_HOMES
    c.JupyterHub.spawner_class = "simple"
    homes = os.environ.get("COURSE_HUB_HOMES", "/tmp/course-hub")
    c.SimpleLocalProcessSpawner.home_dir_template = homes + "/{username}"
    c.Spawner.cmd = ["bash", START_LAB]
    c.Spawner.environment = {
        **student_env, "COURSE_DIR": str(COURSE_DIR), "LAB_IP": "127.0.0.1",
        "PORT": lambda spawner: str(spawner.port),  # start-lab.sh passes --port: the one the hub picked
        "COURSE_ALLOW_ROOT": "1" if os.getuid() == 0 else "0",
    }
