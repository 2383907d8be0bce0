#!/usr/bin/env bash
# Start the class's JupyterHub on one GPU node: each user's JupyterLab in the workshop image (DockerSpawner),
# the Formgrader for the instructors, the idle culler. Runs in the foreground; stop it with Ctrl+C (the labs
# stop with it, their work stays in the course-<user> volumes).
#
#   sudo docker/hub/start.sh [rocm|cuda]
#
# Needs, on this host: the course installed with `make hub` (its .venv, the hub's packages and proxy), the image
# built (`make docker-rocm` or `make docker-cuda`), the class in
# $COURSE_HUB_STATE/users.txt (see users.example.txt), and a system user to autograde as (`grader`).
# Settings: the COURSE_HUB_* variables of jupyterhub_config.py (GPUS, GPU_MAP, MEM_LIMIT, URL, ...).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
course="$(cd "$here/../.." && pwd)"
platform="${1:-${COURSE_HUB_GPU:-rocm}}"
state="${COURSE_HUB_STATE:-/srv/jupyterhub}"
exchange="${COURSE_HUB_EXCHANGE:-/srv/nbgrader/exchange}"
grader_dir="${COURSE_HUB_GRADER_DIR:-/srv/nbgrader/grader}"
grader_user="${COURSE_HUB_GRADER_USER:-grader}"

die() { echo "start.sh: $*" >&2; exit 2; }

case "$platform" in rocm|cuda) ;; *) die "platform must be rocm or cuda, not '$platform'" ;; esac
[ "$(id -u)" = 0 ] || die "run as root: the hub starts containers and runs the Formgrader as $grader_user"
[ -x "$course/.venv/node_modules/.bin/configurable-http-proxy" ] || die "no hub proxy in $course/.venv: run 'make hub' in $course"
[ -f "$state/users.txt" ] || die "no $state/users.txt: copy $here/users.example.txt there and list the class"
id "$grader_user" > /dev/null 2>&1 || die "no user '$grader_user' to autograde as: useradd --system --create-home $grader_user"
docker image inspect "scaling-pytorch-course:$platform" > /dev/null || die "no image scaling-pytorch-course:$platform: make docker-$platform"

mkdir -p "$state" "$exchange" "$grader_dir"
chmod 0777 "$exchange"  # nbgrader's exchange: every container (uid 1000) submits into it, the grader releases
chown "$grader_user:" "$grader_dir"
chmod 0700 "$state"  # the hub's database, cookie secret and password hashes

cd "$state"
export COURSE_HUB_SPAWNER=docker COURSE_HUB_GPU="$platform" COURSE_HUB_STATE="$state" \
       COURSE_HUB_EXCHANGE="$exchange" COURSE_HUB_GRADER_DIR="$grader_dir" COURSE_HUB_GRADER_USER="$grader_user"
export PATH="$course/.venv/bin:$PATH"  # the idle culler and the Formgrader run from the course's environment
exec "$course/.venv/bin/jupyterhub" -f "$here/jupyterhub_config.py"
