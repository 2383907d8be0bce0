#!/usr/bin/env bash
# Serve the course in JupyterLab on one port, with token authentication and nbgrader's extensions.
# The workshop images run this as their entrypoint (as the non-root user `student`); it also runs
# outside Docker, on any machine where the course is installed with `make setup`.
#
#   COURSE_DIR    the course checkout with its .venv        (default /opt/course)
#   WORK_DIR      the folder students work in: mount it    (default $HOME/work)
#   COURSE_ROLE   student: serve WORK_DIR/notebooks; instructor: also WORK_DIR/course, the nbgrader
#                 course (config + solutions/) that the Formgrader works on      (default student)
#                 student: JupyterLab and nbgrader read COURSE_DIR/docker/student-lab (the course's cell limits,
#                 which Validate runs with; no Formgrader, Create Assignment, Course List or news pop-up),
#                 after the folders JUPYTER_CONFIG_PATH already names (the class hub's), which take precedence.
#                 instructor: every nbgrader tool. It needs the instructor edition in COURSE_DIR (the grader image,
#                 or a checkout of the course): the student image holds the student edition, with no solutions/
#                 to grade from
#   PORT, LAB_IP  where JupyterLab listens                  (default 8888, 0.0.0.0)
#   JUPYTER_TOKEN the token; when unset a random one is made and printed
#   NBGRADER_EXCHANGE  nbgrader's exchange folder, written to ~/.jupyter/nbgrader_config.py on the
#                 first start                           (default WORK_DIR/exchange)
#   TORCH_EXTENSIONS_DIR  DeepSpeed's JIT-built ops         (default COURSE_DIR/.venv/torch_extensions)
#   COURSE_ALLOW_ROOT=1  allow running as root (tests outside Docker); refused otherwise
# Extra arguments are passed to `jupyter lab`.
set -euo pipefail

COURSE_DIR="${COURSE_DIR:-/opt/course}"
WORK_DIR="${WORK_DIR:-$HOME/work}"
COURSE_ROLE="${COURSE_ROLE:-student}"
PORT="${PORT:-8888}"
LAB_IP="${LAB_IP:-0.0.0.0}"
JUPYTER="$COURSE_DIR/.venv/bin/jupyter"

die() { echo "start-lab: $*" >&2; exit 2; }

if [ "$(id -u)" = 0 ] && [ "${COURSE_ALLOW_ROOT:-0}" != 1 ]; then
  die "refusing to serve JupyterLab as root: run as an ordinary user (the images' USER is student)"
fi
case "$PORT" in ''|*[!0-9]*) die "PORT=$PORT is not a port number" ;; esac
[ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || die "PORT=$PORT is out of range 1-65535"
case "$COURSE_ROLE" in student|instructor) ;; *) die "COURSE_ROLE=$COURSE_ROLE: use student or instructor" ;; esac
# The instructor copies nbgrader's source (solutions/) and config from the course: only the instructor edition has them.
if [ "$COURSE_ROLE" = instructor ] && { [ ! -d "$COURSE_DIR/solutions" ] || [ ! -f "$COURSE_DIR/nbgrader_config.py" ]; }; then
  what="has no solutions/ or nbgrader_config.py"
  [ ! -e "$COURSE_DIR/.student-edition.json" ] || what="is the student edition (no solutions/, no nbgrader_config.py)"
  die "COURSE_ROLE=instructor needs the instructor edition, and COURSE_DIR=$COURSE_DIR $what. Use the grader" \
      "image (scaling-pytorch-course:rocm-grader or :cuda-grader: docker/run.sh rocm|cuda --instructor) or set" \
      "COURSE_DIR to a checkout of the course repository; the student image serves COURSE_ROLE=student only"
fi
[ -x "$JUPYTER" ] || die "no JupyterLab at $JUPYTER: install the course with 'make setup' in $COURSE_DIR"
[ -d "$COURSE_DIR/notebooks" ] || die "no notebooks/ in COURSE_DIR=$COURSE_DIR"
# A student's lab reads the course's student configuration, after the folders already named (they take precedence).
student_lab="$COURSE_DIR/docker/student-lab"
if [ "$COURSE_ROLE" = student ]; then
  [ -d "$student_lab" ] || die "no docker/student-lab in COURSE_DIR=$COURSE_DIR: a student's lab needs it"
  export JUPYTER_CONFIG_PATH="${JUPYTER_CONFIG_PATH:+$JUPYTER_CONFIG_PATH:}$student_lab"
fi

if [ -z "${JUPYTER_TOKEN:-}" ]; then
  JUPYTER_TOKEN="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
  echo "start-lab: no JUPYTER_TOKEN given; this server's token is $JUPYTER_TOKEN"
fi
export JUPYTER_TOKEN  # jupyter_server reads it from the environment: it never shows in `ps`

# The work folder outlives the container (mount it): copy the course in on the first start only,
# and never overwrite what is there, so a student's edits survive restarts and image updates.
mkdir -p "$WORK_DIR"
if [ ! -e "$WORK_DIR/notebooks" ]; then
  cp -R "$COURSE_DIR/notebooks" "$WORK_DIR/notebooks"
  echo "start-lab: copied the student notebooks to $WORK_DIR/notebooks"
fi
root="$WORK_DIR"
if [ "$COURSE_ROLE" = instructor ]; then
  root="$WORK_DIR/course"
  mkdir -p "$root"
  [ -e "$root/nbgrader_config.py" ] || cp "$COURSE_DIR/nbgrader_config.py" "$root/"
  [ -e "$root/solutions" ] || cp -R "$COURSE_DIR/solutions" "$root/solutions"
fi

# nbgrader's exchange (release/fetch/submit/collect) in the work folder, unless the user configured one.
config_dir="${JUPYTER_CONFIG_DIR:-$HOME/.jupyter}"
if [ ! -e "$config_dir/nbgrader_config.py" ]; then
  exchange="${NBGRADER_EXCHANGE:-$WORK_DIR/exchange}"
  mkdir -p "$config_dir" "$exchange"
  printf 'c = get_config()  # noqa: F821\nc.Exchange.root = %s\n' \
    "$("$COURSE_DIR/.venv/bin/python" -c 'import sys; print(repr(sys.argv[1]))' "$exchange")" \
    > "$config_dir/nbgrader_config.py"
fi

# Kernels and nbgrader's commands come from the course's environment.
export PATH="$COURSE_DIR/.venv/bin:$PATH"
# DeepSpeed's CPU comm op, built by `make setup` (the images set TORCH_EXTENSIONS_DIR to it): loading it
# takes a lock file in its folder, so a folder this user cannot write is copied to one it can.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$COURSE_DIR/.venv/torch_extensions}"
ext="$TORCH_EXTENSIONS_DIR" own="$HOME/.cache/course_torch_extensions"
if [ -d "$ext" ] && { [ ! -w "$ext" ] || { [ -d "$ext/deepspeed_shm_comm" ] && [ ! -w "$ext/deepspeed_shm_comm" ]; }; }; then
  [ -e "$own" ] || { mkdir -p "$(dirname "$own")" && cp -Rp "$ext" "$own"; }
  export TORCH_EXTENSIONS_DIR="$own"
elif [ ! -e "$ext" ] && [ ! -w "$(dirname "$ext")" ]; then
  export TORCH_EXTENSIONS_DIR="$own"  # nothing prebuilt: DeepSpeed builds it there on first use
fi
as_root=()
[ "$(id -u)" = 0 ] && as_root=(--allow-root)  # only reached with COURSE_ALLOW_ROOT=1
cd "$root"
exec "$JUPYTER" lab --no-browser --ip="$LAB_IP" --port="$PORT" --port-retries=0 \
  --ServerApp.root_dir="$root" "${as_root[@]}" "$@"
