"""JupyterHub for a whole class: each student's JupyterLab with the course, nbgrader's Formgrader for the instructors.

    COURSE_HUB_SPAWNER=docker  one GPU node: each user's lab in the student image (docker/README.md), a GPU share each
    COURSE_HUB_SPAWNER=slurm   a cluster: each user's lab is a SLURM job on a GPU partition (batchspawner), on the
                               student edition that start.sh builds
    COURSE_HUB_SPAWNER=local   a plain process per user, no isolation: only for tests/test_hub.py

Students get the student edition (no solutions, tests or graded references: course_grader/edition.py); the Formgrader
runs from the instructor's checkout (COURSE_DIR). Students submit through the exchange service
(exchange_service.py), which files each submission under the hub user and its own clock's time; the
Formgrader's collect (grader/grader_exchange.py) takes only what that service filed.

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
# the student image (`make docker-rocm`)
IMAGE = os.environ.get("COURSE_HUB_IMAGE", f"scaling-pytorch-course:{PLATFORM}")
MEM_LIMIT = os.environ.get("COURSE_HUB_MEM_LIMIT", "96G")  # per user; an 8x MI300X node has 1.5-2 TB
SHM_SIZE = "64G"  # seed 001's --shm-size, as docker/run.sh
IDLE_TIMEOUT = int(os.environ.get("COURSE_HUB_IDLE_TIMEOUT", "3600"))  # s; the culler stops idle labs, work stays
COURSE_ID = "scaling-pytorch-training"  # the course's nbgrader_config.py; also the Formgrader service's name
EXCHANGE = os.environ.get("COURSE_HUB_EXCHANGE", "/srv/nbgrader/exchange")  # nbgrader's exchange, shared by all
GRADER_DIR = os.environ.get("COURSE_HUB_GRADER_DIR", "/srv/nbgrader/grader")  # the Formgrader's course is in course/
GRADER_PORT = int(os.environ.get("COURSE_HUB_GRADER_PORT", "9999"))
GRADER_USER = os.environ.get("COURSE_HUB_GRADER_USER", "grader")  # runs students' code when autograding: not root
START_LAB = str(COURSE_DIR / "docker" / "start-lab.sh")  # the images' entrypoint, also run by the grader
# slurm and local: what the labs run on, never COURSE_DIR (start.sh builds the edition, copies the student config)
EDITION = Path(os.environ.get("COURSE_HUB_EDITION", STATE / "student-edition"))  # course_grader.edition student
LAB_VENV = Path(os.environ.get("COURSE_HUB_LAB_VENV", STATE / "lab-venv"))  # slurm: the labs' Python (README)
EXCHANGE_SERVICE = "course-exchange"  # files submissions (exchange_service.py); the labs post to it directly
EXCHANGE_PORT = int(os.environ.get("COURSE_HUB_EXCHANGE_PORT", "9998"))
EXCHANGE_MAX_MB = os.environ.get("COURSE_HUB_EXCHANGE_MAX_MB", "100")  # one submission; nbgrader's max_dir_size
LEDGER = os.environ.get("COURSE_HUB_LEDGER", f"{GRADER_DIR}/exchange-ledger.jsonl")  # what the service filed
SLURM = dict(partition="gpu", time="01:00:00", cpus_per_gpu=12)  # course_lib.apps.cluster.Job's defaults
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
STUDENTS = sorted(name for name, role in ROLES.items() if role == "student")  # who may submit

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
    "students": {"users": STUDENTS},
    f"formgrade-{COURSE_ID}": {"users": INSTRUCTORS},  # add TAs here to let them grade without being admins
}
c.JupyterHub.load_roles = [
    {"name": f"formgrade-{COURSE_ID}", "groups": [f"formgrade-{COURSE_ID}"],
     "scopes": [f"access:services!service={COURSE_ID}"]},
    {"name": "idle-culler", "services": ["idle-culler"],
     "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]},
    # students may use the exchange service, and their labs' tokens carry that right (server_token_scopes)
    {"name": "exchange-submit", "groups": ["students"], "scopes": [f"access:services!service={EXCHANGE_SERVICE}"]},
]
# a lab's JUPYTERHUB_API_TOKEN: the hub's default server scopes, plus the exchange service for students (a token
# gets the subset its user holds): the service learns from this token whose submission it is
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server",
                                 f"access:services!service={EXCHANGE_SERVICE}"]
grader = {
    "name": COURSE_ID,
    "url": f"http://127.0.0.1:{GRADER_PORT}",
    # start-lab.sh as instructor: copies the course's nbgrader config and solutions/ into GRADER_DIR/course once
    "command": ["bash", START_LAB],
    "cwd": GRADER_DIR,
    "environment": {
        "COURSE_DIR": str(COURSE_DIR), "COURSE_ROLE": "instructor", "WORK_DIR": GRADER_DIR,
        "PORT": str(GRADER_PORT), "LAB_IP": "127.0.0.1", "NBGRADER_EXCHANGE": EXCHANGE,
        "JUPYTER_CONFIG_PATH": str(HERE / "grader"),  # hub extension, Lab may frame the Formgrader, ledger collect
        "COURSE_EXCHANGE_LEDGER": LEDGER,
        "JUPYTERHUB_DEFAULT_URL": "/lab",
    },
    "oauth_no_confirm": True,
}
if MODE == "local":  # the test runs as root with no system users: the grader runs as the hub's user
    as_root = "1" if os.getuid() == 0 else "0"  # the lab and the grading (course_grader.sandbox.refuse_root)
    grader["environment"].update(HOME=f"{GRADER_DIR}/home", COURSE_ALLOW_ROOT=as_root, COURSE_GRADE_AS_ROOT=as_root)
else:
    grader["user"] = GRADER_USER
# the exchange service listens where the labs reach it: the docker bridge, this host for cluster nodes, loopback
SERVICE_IP = {"docker": "172.17.0.1", "slurm": "0.0.0.0", "local": "127.0.0.1"}[MODE]
LAB_REACHES = {"docker": "172.17.0.1", "slurm": os.environ.get("COURSE_HUB_CONNECT_IP", socket.getfqdn()),
               "local": "127.0.0.1"}[MODE]
exchange_service = {
    "name": EXCHANGE_SERVICE,
    "url": f"http://{SERVICE_IP}:{EXCHANGE_PORT}",
    "command": [sys.executable, str(HERE / "exchange_service.py")],
    "environment": {
        "COURSE_EXCHANGE_ROOT": EXCHANGE, "COURSE_ID": COURSE_ID, "COURSE_EXCHANGE_STUDENTS": ",".join(STUDENTS),
        "COURSE_EXCHANGE_LEDGER": LEDGER, "COURSE_EXCHANGE_MAX_MB": EXCHANGE_MAX_MB,
    },
}
if MODE != "local":
    exchange_service["user"] = GRADER_USER  # inbound/ and the ledger are the grader's; students cannot write them
c.JupyterHub.services = [
    grader,
    exchange_service,
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
    """docker run's GPU and memory flags for this user: what ROCm or CUDA needs, and nothing shared between users.

    As docker/run.sh, and unlike seed 001, no `--ipc host`: each container keeps its own IPC namespace
    ("private": no other container can join it), so one student's processes cannot reach another's shared
    memory. A student's ranks all run in their own container, so PyTorch's DataLoader workers and RCCL/NCCL's
    intra-node shared-memory transport work inside it on its own /dev/shm (shm_size). No SYS_PTRACE (it lets a
    process read another's memory; py-spy-style tools need it, the course does not) and the default seccomp
    profile (ROCm's docs list seccomp=unconfined as optional, for numactl's memory policies in HPC set-ups).
    """
    gpus = gpus_for(spawner.user.name)
    if PLATFORM == "rocm":
        nodes = render_nodes(gpus)
        # /dev/kfd: ROCm's compute interface, shared by all GPUs; /dev/dri/renderD<N>: one per GPU, only this user's
        # (ROCm's docs: "Restricting GPU access"). Both are group video or render on the host: the container's
        # user gets those groups (render has no fixed gid, so the render node's own gid is added)
        groups = ["video"] + sorted({str(os.stat(n).st_gid) for n in nodes[:1] if os.path.exists(n)})
        return dict(devices=["/dev/kfd", *nodes], group_add=groups, ipc_mode="private", shm_size=SHM_SIZE)
    # CUDA: the NVIDIA runtime's device request for this user's GPUs; NVIDIA's recommended ulimits for PyTorch
    # (pinned memory unlimited, 64 MB stack)
    return dict(device_requests=[dict(driver="nvidia", device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])],
                ipc_mode="private", shm_size=SHM_SIZE,
                ulimits=[dict(name="memlock", soft=-1, hard=-1), dict(name="stack", soft=67108864, hard=67108864)])


# --- where each user's lab runs ---------------------------------------------------------------------------------
STUDENT_CONFIG = HERE / "student"  # the hub's part: hub extension, student id = hub name, the exchange plugins
if MODE == "slurm":  # COURSE_DIR is closed to students on a cluster: start.sh copies the folder out
    STUDENT_CONFIG = Path(os.environ.get("COURSE_HUB_STUDENT_CONFIG", STATE / "student-config"))
# A student's lab reads the hub's folder first, then the course's student configuration, docker/student-lab/ of the
# edition it runs on (cell limits; no Formgrader, Create Assignment, Course List or news pop-up). start-lab.sh adds
# that one itself (docker: the image's edition; local); a SLURM lab runs without start-lab.sh, so it is named here.
LAB_CONFIG_PATH = [STUDENT_CONFIG] + ([EDITION / "docker" / "student-lab"] if MODE == "slurm" else [])
student_env = {  # read by start-lab.sh, and by nbgrader through JUPYTER_CONFIG_PATH
    "COURSE_ROLE": "student",
    "NBGRADER_EXCHANGE": EXCHANGE,
    "JUPYTER_CONFIG_PATH": os.pathsep.join(map(str, LAB_CONFIG_PATH)),
    "COURSE_EXCHANGE_URL": f"http://{LAB_REACHES}:{EXCHANGE_PORT}/services/{EXCHANGE_SERVICE}/",
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
        # the exchange, read-only and only what students read: released assignments and feedback. inbound/ (every
        # submission) is not there at all: the exchange service writes it as the grader
        **{f"{EXCHANGE}/{COURSE_ID}/{part}": {"bind": f"{EXCHANGE}/{COURSE_ID}/{part}", "mode": "ro"}
           for part in ("outbound", "feedback")},
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
    # The labs run on the student edition and a Python environment made from it (LAB_VENV), both readable by
    # students; COURSE_DIR (solutions, tests, references) is not (README: "On a SLURM cluster").
    c.SlurmSpawner.req_prologue = (
        f"export PATH={LAB_VENV}/bin:$PATH PYTHONPATH={EDITION} TORCH_EXTENSIONS_DIR=$HOME/.cache/torch_extensions\n"
        # DeepSpeed's ops that `make setup` built, copied where this user may take their lock files (as start-lab.sh)
        f"mkdir -p ~/.cache && {{ [ -e ~/.cache/torch_extensions ] || cp -Rp {LAB_VENV}/torch_extensions ~/.cache/ "
        "2>/dev/null || true; }\n"
        f"mkdir -p ~/work && {{ [ -e ~/work/notebooks ] || cp -R {EDITION}/notebooks ~/work/; }}"
    )
    c.SlurmSpawner.cmd = [f"{LAB_VENV}/bin/jupyterhub-singleuser"]
    c.SlurmSpawner.notebook_dir = "~/work"
    c.SlurmSpawner.environment = student_env

else:  # local: tests only. Every lab runs as the hub's user, in a home under COURSE_HUB_HOMES
    # Labs run the student edition's entrypoint on the edition (COURSE_DIR=EDITION: its notebooks; its course_lib
    # first on PYTHONPATH). Its .venv may be a link to the checkout's (the test makes one): local mode isolates
    # nothing, everything runs as one user (README: "What is tested").
    c.JupyterHub.spawner_class = "simple"
    homes = os.environ.get("COURSE_HUB_HOMES", "/tmp/course-hub")
    c.SimpleLocalProcessSpawner.home_dir_template = homes + "/{username}"
    c.Spawner.cmd = ["bash", str(EDITION / "docker" / "start-lab.sh")]
    c.Spawner.environment = {
        **student_env, "COURSE_DIR": str(EDITION), "PYTHONPATH": str(EDITION), "LAB_IP": "127.0.0.1",
        "PORT": lambda spawner: str(spawner.port),  # start-lab.sh passes --port: the one the hub picked
        "COURSE_ALLOW_ROOT": "1" if os.getuid() == 0 else "0",
    }
