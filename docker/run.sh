#!/usr/bin/env bash
# Start a workshop container: JupyterLab with the course on one port, the student's work in a host
# folder that outlives the container, and the GPU flags of its platform.
#
#   docker/run.sh rocm|cuda [--instructor] [--port 8888] [--work DIR] [--name NAME] [--image IMAGE]
#                           [--shm-size 64G] [--gpus 0,1 | --no-gpus] [--dry-run] [-- EXTRA DOCKER RUN ARGS]
#
# A student gets the student image (scaling-pytorch-course:rocm or :cuda: the student edition, no solutions/ or
# tests/); --instructor gets the grader image (scaling-pytorch-course:rocm-grader or :cuda-grader, the whole
# course) with COURSE_ROLE=instructor, for the Formgrader. --image overrides either. Both get the same flags:
# rocm: --device /dev/kfd and --device /dev/dri (or only the chosen GPUs' render nodes), --group-add video and the
# render group, --ipc private and --shm-size; cuda: --gpus, --ipc private, --shm-size and NCCL's ulimits.
# Each flag, and why seed 001's --ipc host, SYS_PTRACE and unconfined seccomp are not given, is said in this script
# and in docker/README.md. Site-specific flags go after `--`. JUPYTER_TOKEN is passed by
# name (never on the command line); when unset, one is made and printed. --dry-run prints the docker command.
# --gpus 0,1 gives the container only those GPUs (host indices), so students sharing a node do not all
# launch on the same devices: rocm passes only their render nodes (/dev/kfd stays), cuda --gpus device=.
# Inside, the chosen GPUs are numbered from 0 (HIP/ROCR/CUDA_VISIBLE_DEVICES=0,1,...). ROCm index i is
# the i-th GPU node of the KFD topology (its drm_render_minor gives /dev/dri/renderD<minor>), the order
# rocm-smi and HIP use; with no topology (not a ROCm host) GPU i is assumed to be renderD(128+i).
# KFD_TOPOLOGY (default /sys/class/kfd/kfd/topology/nodes) and DRI_DIR (default /dev/dri, where the render group
# is read from) point run.sh at another host layout; the tests use them. CONTAINER_ENGINE=podman runs podman instead
# of docker. --no-gpus gives no GPU device, group or NVIDIA flag (--ipc private and --shm-size stay): for an image
# built FROM a stand-in base on a machine with no GPU (docker/images_check.sh), never for a workshop.
set -euo pipefail

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "run.sh: $*" >&2; exit 2; }

[ $# -ge 1 ] || usage 2
platform="$1"; shift
case "$platform" in rocm|cuda) ;; -h|--help) usage 0 ;; *) die "first argument must be rocm or cuda, not '$platform'" ;; esac

port=8888; work="$PWD/workshop-work"; name=""; image=""
shm=64G; role=student; dry=0; extra=(); gpus=""; no_gpus=0
engine="${CONTAINER_ENGINE:-docker}"
case "$engine" in docker|podman) ;; *) die "CONTAINER_ENGINE=$engine: use docker or podman" ;; esac
dri="${DRI_DIR:-/dev/dri}"
while [ $# -gt 0 ]; do
  case "$1" in
    --instructor) role=instructor ;;
    --port) port="${2:?--port needs a value}"; shift ;;
    --work) work="${2:?--work needs a folder}"; shift ;;
    --name) name="${2:?--name needs a value}"; shift ;;
    --image) image="${2:?--image needs a value}"; shift ;;
    --shm-size) shm="${2:?--shm-size needs a value}"; shift ;;
    --gpus) gpus="${2:?--gpus needs a list of GPU indices, e.g. 0,1}"; shift ;;
    --no-gpus) no_gpus=1 ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done
# The student image holds the student edition only; the instructor's role needs the grader image (start-lab.sh
# refuses COURSE_ROLE=instructor in the student image).
if [ "$role" = instructor ]; then
  image="${image:-scaling-pytorch-course:$platform-grader}"; name="${name:-scaling-course-$platform-grader}"
else
  image="${image:-scaling-pytorch-course:$platform}"; name="${name:-scaling-course-$platform}"
fi
case "$shm" in *[0-9]*) ;; *) die "--shm-size $shm: give a size such as 16G" ;; esac
case "$port" in ''|*[!0-9]*) die "--port $port is not a port number" ;; esac
[ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "--port $port is out of range 1-65535"
[ "$no_gpus" = 0 ] || [ -z "$gpus" ] || die "--gpus and --no-gpus: give one of them"
gpu_list=()
if [ -n "$gpus" ]; then
  [[ "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus $gpus: give GPU indices separated by commas, e.g. --gpus 0,1"
  IFS=, read -r -a gpu_list <<< "$gpus"
  [ "$(printf '%s\n' "${gpu_list[@]}" | sort -n | uniq -d)" = "" ] || die "--gpus $gpus names a GPU twice"
  for arg in "${extra[@]}"; do
    [ "$arg" != --privileged ] || die "--gpus with --privileged would still show every GPU: drop one of them"
  done
fi

# The render node of each ROCm GPU index, in the order of the KFD topology (CPU nodes have gpu_id 0).
render_nodes() {
  local topology="${KFD_TOPOLOGY:-/sys/class/kfd/kfd/topology/nodes}" node minors=()
  if [ -d "$topology" ]; then
    for node in $(find "$topology" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -n); do
      [ "$(cat "$topology/$node/gpu_id" 2>/dev/null || echo 0)" != 0 ] || continue
      minors+=("$(awk '$1 == "drm_render_minor" {print $2}' "$topology/$node/properties")")
    done
  else
    echo "run.sh: no KFD topology at $topology: assuming GPU i is /dev/dri/renderD(128+i)" >&2
    local i
    for i in "${gpu_list[@]}"; do minors[i]=$((128 + i)); done
  fi
  local gpu
  for gpu in "${gpu_list[@]}"; do
    [ -n "${minors[gpu]:-}" ] || die "--gpus $gpus: this host has no GPU $gpu (found ${#minors[@]} in $topology)"
    echo "/dev/dri/renderD${minors[gpu]}"
  done
}

mkdir -p "$work"
work="$(cd "$work" && pwd)"
if [ -z "${JUPYTER_TOKEN:-}" ]; then
  JUPYTER_TOKEN="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
fi
export JUPYTER_TOKEN

cmd=("$engine" run --rm -d --name "$name" -p "$port:8888"
     -e JUPYTER_TOKEN -e COURSE_ROLE="$role"
     -v "$work:/home/student/work")
visible=""
[ ${#gpu_list[@]} = 0 ] || visible="$(seq -s, 0 $((${#gpu_list[@]} - 1)))"  # renumbered from 0 inside
# Shared memory: --ipc private gives the container an IPC namespace (System V segments, POSIX /dev/shm) that no
# other container can join, so students on one node cannot reach each other's shared memory (seed 001's
# --ipc host would put every container in the host's). --shm-size sizes the container's own /dev/shm (Docker's
# default is 64 MB): PyTorch's DataLoader workers pass batches through it, and NCCL/RCCL's intra-node transport
# makes its segments there (NCCL's troubleshooting guide: "--shm-size=1g --ulimit memlock=-1" in Docker).
# All of a student's ranks run in their one container, so they share that /dev/shm. It is a tmpfs limit, not a
# reservation: pages count against the container's memory only when written.
if [ "$no_gpus" = 1 ]; then
  # no GPU on this machine (a stand-in image): no device, group or NVIDIA flag; the container's own shared memory stays
  cmd+=(--ipc private --shm-size "$shm")
elif [ "$platform" = rocm ]; then
  # /dev/kfd: ROCm's compute interface, one for all GPUs. /dev/dri: the GPUs' render nodes (renderD*), one per GPU;
  # with --gpus only the chosen ones (ROCm's "Running ROCm Docker containers", rocm.docs.amd.com).
  cmd+=(--device /dev/kfd)
  if [ -n "$gpus" ]; then
    nodes="$(render_nodes)"
    for node in $nodes; do cmd+=(--device "$node"); done
    cmd+=(-e "HIP_VISIBLE_DEVICES=$visible" -e "ROCR_VISIBLE_DEVICES=$visible")
  else
    cmd+=(--device /dev/dri)
  fi
  # The device files belong to the host's video and render groups (mode 0660): the image's user is in video,
  # and the render group is added by its number on this host (the image's /etc/group need not have it).
  cmd+=(--group-add video)
  render_gid=""
  for node in "$dri"/renderD*; do
    [ -e "$node" ] && render_gid="$(stat -c %g "$node")" && break
  done
  if [ -n "$render_gid" ]; then
    cmd+=(--group-add "$render_gid")
  else
    echo "run.sh: no render node in $dri: add --group-add <gid of the host's render group> after -- on the GPU host" >&2
  fi
  # Not given (seed 001 has them for a benchmarking shell): --cap-add SYS_PTRACE and --security-opt
  # seccomp=unconfined are what debuggers (rocgdb, gdb, rr) need: ptrace to attach, and personality() to turn off
  # address randomization, which Docker's default seccomp profile refuses. Running needs neither: ROCm's container
  # docs (rocm.docs.amd.com, "Running ROCm Docker containers") list /dev/kfd and /dev/dri and call seccomp=unconfined
  # optional, for numactl's memory-policy calls (mbind, set_mempolicy), which Docker's default profile allows to a
  # container with CAP_SYS_NICE. An instructor who debugs in their own container adds them after --.
  cmd+=(--ipc private --shm-size "$shm")
else
  # --gpus: the NVIDIA container toolkit's device request (all GPUs, or the chosen ones).
  if [ -n "$gpus" ]; then
    cmd+=(--gpus "\"device=$gpus\"" -e "CUDA_VISIBLE_DEVICES=$visible")
  else
    cmd+=(--gpus all)
  fi
  # memlock=-1: NCCL and CUDA pin host memory; stack=64 MB: NVIDIA's recommended ulimits for its PyTorch images.
  cmd+=(--ipc private --shm-size "$shm" --ulimit memlock=-1 --ulimit stack=67108864)
fi
cmd+=("${extra[@]}" "$image")

if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
"${cmd[@]}"
echo "JupyterLab ($role, $image): http://localhost:$port/lab?token=$JUPYTER_TOKEN"
echo "work folder: $work (mounted at /home/student/work; it survives the container)"
echo "logs: $engine logs -f $name    stop: $engine stop $name"
