#!/usr/bin/env bash
# Start a workshop container: JupyterLab with the course on one port, the student's work in a host
# folder that outlives the container, and the GPU flags of its platform.
#
#   docker/run.sh rocm|cuda [--instructor] [--port 8888] [--work DIR] [--name NAME] [--image IMAGE]
#                           [--shm-size 64G] [--gpus 0,1] [--dry-run] [-- EXTRA DOCKER RUN ARGS]
#
# rocm carries seed 001's flags for MI300X: --device /dev/kfd --device /dev/dri --group-add video
# --ipc host --shm-size 64G --cap-add SYS_PTRACE --security-opt seccomp=unconfined (plus the render
# group of /dev/dri/renderD*, by number, when the host has one). Seed 001 also gives --privileged,
# --network host and $HOME mounts for a benchmarking shell; a notebook server does not need them:
# add them after `--` if your site wants them. cuda uses --gpus all with NVIDIA's recommended
# --ipc host and ulimits. JUPYTER_TOKEN is passed by name (never on the command line); when unset,
# one is made and printed. --dry-run prints the docker command instead of running it.
# --gpus 0,1 gives the container only those GPUs (host indices), so students sharing a node do not all
# launch on the same devices: rocm passes only their render nodes (/dev/kfd stays), cuda --gpus device=.
# Inside, the chosen GPUs are numbered from 0 (HIP/ROCR/CUDA_VISIBLE_DEVICES=0,1,...). ROCm index i is
# the i-th GPU node of the KFD topology (its drm_render_minor gives /dev/dri/renderD<minor>), the order
# rocm-smi and HIP use; with no topology (not a ROCm host) GPU i is assumed to be renderD(128+i).
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "run.sh: $*" >&2; exit 2; }

[ $# -ge 1 ] || usage 2
platform="$1"; shift
case "$platform" in rocm|cuda) ;; -h|--help) usage 0 ;; *) die "first argument must be rocm or cuda, not '$platform'" ;; esac

port=8888; work="$PWD/workshop-work"; name="scaling-course-$platform"; image="scaling-pytorch-course:$platform"
shm=64G; role=student; dry=0; extra=(); gpus=""
while [ $# -gt 0 ]; do
  case "$1" in
    --instructor) role=instructor ;;
    --port) port="${2:?--port needs a value}"; shift ;;
    --work) work="${2:?--work needs a folder}"; shift ;;
    --name) name="${2:?--name needs a value}"; shift ;;
    --image) image="${2:?--image needs a value}"; shift ;;
    --shm-size) shm="${2:?--shm-size needs a value}"; shift ;;
    --gpus) gpus="${2:?--gpus needs a list of GPU indices, e.g. 0,1}"; shift ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done
case "$port" in ''|*[!0-9]*) die "--port $port is not a port number" ;; esac
[ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "--port $port is out of range 1-65535"
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

cmd=(docker run --rm -d --name "$name" -p "$port:8888"
     -e JUPYTER_TOKEN -e COURSE_ROLE="$role"
     -v "$work:/home/student/work")
visible=""
[ ${#gpu_list[@]} = 0 ] || visible="$(seq -s, 0 $((${#gpu_list[@]} - 1)))"  # renumbered from 0 inside
if [ "$platform" = rocm ]; then
  cmd+=(--device /dev/kfd)
  if [ -n "$gpus" ]; then
    nodes="$(render_nodes)"
    for node in $nodes; do cmd+=(--device "$node"); done
    cmd+=(-e "HIP_VISIBLE_DEVICES=$visible" -e "ROCR_VISIBLE_DEVICES=$visible")
  else
    cmd+=(--device /dev/dri)
  fi
  cmd+=(--group-add video --ipc host --shm-size "$shm" --cap-add SYS_PTRACE --security-opt seccomp=unconfined)
  for node in /dev/dri/renderD*; do
    [ -e "$node" ] && cmd+=(--group-add "$(stat -c %g "$node")") && break
  done
else
  if [ -n "$gpus" ]; then
    cmd+=(--gpus "\"device=$gpus\"" -e "CUDA_VISIBLE_DEVICES=$visible")
  else
    cmd+=(--gpus all)
  fi
  cmd+=(--ipc host --shm-size "$shm" --ulimit memlock=-1 --ulimit stack=67108864)
fi
cmd+=("${extra[@]}" "$image")

if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
"${cmd[@]}"
echo "JupyterLab ($role): http://localhost:$port/lab?token=$JUPYTER_TOKEN"
echo "work folder: $work (mounted at /home/student/work; it survives the container)"
echo "logs: docker logs -f $name    stop: docker stop $name"
