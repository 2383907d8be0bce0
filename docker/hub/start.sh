#!/usr/bin/env bash
# Start the class's JupyterHub: each user's JupyterLab on the student edition, the Formgrader for the instructors,
# the exchange service that files submissions, the idle culler. Runs in the foreground; stop it with Ctrl+C (the
# labs stop with it, their work stays in the course-<user> volumes or the users' homes).
#
#   sudo docker/hub/start.sh [rocm|cuda]                   one GPU node: each lab in the student image (DockerSpawner)
#   sudo COURSE_HUB_SPAWNER=slurm docker/hub/start.sh      a cluster: each lab a SLURM job on the student edition
#
# Needs, on this host: the course installed with `make hub` (its .venv, the hub's packages and proxy), the class in
# $COURSE_HUB_STATE/users.txt (see users.example.txt), and a system user to autograde as (`grader`). docker: the
# student image built (`make docker-rocm` or `make docker-cuda`). slurm: the labs' Python environment (README).
# Settings: the COURSE_HUB_* variables of jupyterhub_config.py (GPUS, GPU_MAP, MEM_LIMIT, URL, ...).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
course="$(cd "$here/../.." && pwd)"
mode="${COURSE_HUB_SPAWNER:-docker}"
platform="${1:-${COURSE_HUB_GPU:-rocm}}"
state="${COURSE_HUB_STATE:-/srv/jupyterhub}"
exchange="${COURSE_HUB_EXCHANGE:-/srv/nbgrader/exchange}"
grader_dir="${COURSE_HUB_GRADER_DIR:-/srv/nbgrader/grader}"
grader_user="${COURSE_HUB_GRADER_USER:-grader}"
course_id="scaling-pytorch-training"  # jupyterhub_config.py's COURSE_ID
edition="${COURSE_HUB_EDITION:-$state/student-edition}"
student_config="${COURSE_HUB_STUDENT_CONFIG:-$state/student-config}"
lab_venv="${COURSE_HUB_LAB_VENV:-$state/lab-venv}"

die() { echo "start.sh: $*" >&2; exit 2; }

case "$platform" in rocm|cuda) ;; *) die "platform must be rocm or cuda, not '$platform'" ;; esac
case "$mode" in docker|slurm) ;; *) die "COURSE_HUB_SPAWNER=$mode: start.sh starts docker or slurm (local is for tests)" ;; esac
[ "$(id -u)" = 0 ] || die "run as root: the hub starts labs and runs the Formgrader and the exchange as $grader_user"
[ -x "$course/.venv/node_modules/.bin/configurable-http-proxy" ] || die "no hub proxy in $course/.venv: run 'make hub' in $course"
[ -f "$state/users.txt" ] || die "no $state/users.txt: copy $here/users.example.txt there and list the class"
id "$grader_user" > /dev/null 2>&1 || die "no user '$grader_user' to autograde as: useradd --system --create-home $grader_user"
if [ "$mode" = docker ]; then
  docker image inspect "scaling-pytorch-course:$platform" > /dev/null \
    || die "no student image scaling-pytorch-course:$platform: make docker-$platform"
fi

# The exchange: its root is root's (no one can swap the course folder), the course folder the grader's. Students
# read outbound/ (released assignments) and feedback/ (0711: a file only by its name, which only its submitter
# can compute); inbound/ is the grader's alone: the exchange service writes every submission there. The
# containers mount outbound/ and feedback/ read-only, nothing else.
mkdir -p "$state" "$grader_dir" "$exchange/$course_id/outbound" "$exchange/$course_id/feedback" "$exchange/$course_id/inbound"
chown root: "$exchange"
chown "$grader_user:" "$exchange/$course_id" "$exchange/$course_id"/{outbound,feedback,inbound} "$grader_dir"
chmod 0755 "$exchange" "$exchange/$course_id" "$exchange/$course_id/outbound"
chmod 0711 "$exchange/$course_id/feedback"
chmod 0700 "$exchange/$course_id/inbound" "$grader_dir"  # submissions, the ledger, the Formgrader's course
chmod 0700 "$state"  # the hub's database, cookie secret and password hashes

if [ "$mode" = slurm ]; then
  # The labs read the student edition (with its docker/student-lab/), the hub's student config and their Python
  # from here, never from the checkout: the state folder opens for traversal only (0711), the hub's own files stay
  # 0600 (umask below). The config copy is docker/hub/student/ exactly: it takes precedence over the edition's
  # student-lab/, so no file that is gone from the checkout may linger in it.
  "$course/.venv/bin/python" "$course/course_grader/edition.py" student "$edition"
  if [ -e "$student_config" ] && [ ! -f "$student_config/course_exchange.py" ]; then
    die "$student_config exists and is not a copy of $here/student: move it away, or set COURSE_HUB_STUDENT_CONFIG"
  fi
  rm -rf "$student_config" && mkdir -p "$(dirname "$student_config")" && cp -R "$here/student" "$student_config"
  chmod -R a+rX "$edition" "$student_config"
  [ -x "$lab_venv/bin/jupyterhub-singleuser" ] \
    || die "no labs' Python at $lab_venv: make -C $edition setup VENV=$lab_venv (README: On a SLURM cluster)"
  find "$state" -mindepth 1 -maxdepth 1 ! -path "$edition" ! -path "$student_config" ! -path "$lab_venv" \
    -exec chmod go-rwx {} +
  chmod 0711 "$state"
fi

# the hub's database and cookie secret go to its working folder: the state folder itself (0700) for docker, a
# private folder in it for slurm (the state folder is open for traversal there)
hub_home="$state"
[ "$mode" = docker ] || { mkdir -p "$state/hub" && chmod 0700 "$state/hub" && hub_home="$state/hub"; }
cd "$hub_home"
export COURSE_HUB_SPAWNER="$mode" COURSE_HUB_GPU="$platform" COURSE_HUB_STATE="$state" COURSE_HUB_EXCHANGE="$exchange" \
       COURSE_HUB_GRADER_DIR="$grader_dir" COURSE_HUB_GRADER_USER="$grader_user" COURSE_HUB_EDITION="$edition" \
       COURSE_HUB_STUDENT_CONFIG="$student_config" COURSE_HUB_LAB_VENV="$lab_venv"
export PATH="$course/.venv/bin:$PATH"  # the idle culler, the Formgrader and the exchange run from the course's environment
exec "$course/.venv/bin/jupyterhub" -f "$here/jupyterhub_config.py"
