#!/usr/bin/env bash
# Build both targets of both workshop Dockerfiles FROM stand-ins for the vendor images, and run them: `make images-check`.
#
# The vendor bases (rocm/primus, nvcr.io/nvidia/pytorch) cannot be pulled here and need GPUs. The stand-ins have their
# layout with a CPU torch: Debian bookworm (debootstrap, `podman import`) with torch in the system site-packages and
# NGC's PIP_CONSTRAINT (docker/standin/Containerfile.ngc), or in the venv /opt/venv first on PATH
# (docker/standin/Containerfile.primus). Each Dockerfile is built with --build-arg STANDIN_BASE=1, which skips exactly
# the steps that need the vendor's GPU torch or toolchain and prints "STANDIN_BASE=1: SKIPPED ..." for each. Then:
#   student image: no layer holds solutions/, tests/, nbgrader_config.py, a *_hidden.py or a graded reference
#     (course_grader/edition.py's rules); docker/run.sh starts it; JupyterLab is served as its non-root user; headless
#     Chromium opens notebook 00 (a correct student's answers written in), runs its first cells and presses nbgrader's
#     Validate, which must answer "Success"; the instructor's role is refused.
#   grader image: nbgrader autograde, as the image's non-root user, of a correct submission (full marks) and an
#     untouched release (fewer points) of 00_orientation.
# It prints a table of the steps: pass/FAIL/skip and seconds. Logs: runs/images-check/; Chromium's screenshots:
# runs/test-artifacts/browser_images-check-*.png.
#
# Root, on Debian (bookworm): it installs what it needs (podman, runc, debootstrap, chromium) with apt-get. Podman runs
# with runc and cgroupfs (crun refuses some kernels' cgroup setups) and keeps its images under IMAGES_CACHE
# (default /var/tmp/course-images), with the debootstrap folder: a second run reuses every layer.
#   IMAGES_CHECK_FLAVOURS="cuda rocm"   which Dockerfiles
#   IMAGES_CHECK_KEEP=1                  leave the containers running (names in the table's log)
#   TORCH_WHEEL_SPEC=torch==2.13.0       the stand-ins' torch, by `pip download` (a CPU wheel for Debian's Python 3.11)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT="$PWD"
CACHE="${IMAGES_CACHE:-/var/tmp/course-images}"
FLAVOURS="${IMAGES_CHECK_FLAVOURS:-cuda rocm}"
TORCH_WHEEL_SPEC="${TORCH_WHEEL_SPEC:-torch==2.13.0}"
LOGS="$ROOT/runs/images-check"
PY="$ROOT/.venv/bin/python"
# the stand-ins' Debian: Python with pip and venv, and the compilers and headers both vendors' images ship (DeepSpeed's
# CPU ops are compiled by `make setup`); the image's tag follows the list, so a change makes a new one
ROOTFS_PACKAGES="python3,python3-pip,python3-venv,python3-dev,g++,ca-certificates"
ROOTFS_IMAGE="localhost/course-standin-rootfs:bookworm-$(echo "$ROOTFS_PACKAGES" | md5sum | cut -c1-8)"
PORT_BASE="${IMAGES_CHECK_PORT:-18870}"
mkdir -p "$LOGS" "$CACHE"
export CONTAINERS_CONF="$CACHE/containers.conf" CONTAINERS_STORAGE_CONF="$CACHE/storage.conf"

die() { echo "images-check: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "run as root (podman's rootful storage, debootstrap, apt-get)"
[ -x "$PY" ] || die "no $PY: run 'make .venv/.installed' first (the browser and the checks run from the course's venv)"

rows=()      # "name|status|seconds"
failed=0
t_all=$(date +%s)
# step NAME CMD...: run CMD with its output in runs/images-check/NAME.log; one row of the table
step() {
  local name="$1" t0 rc
  shift
  t0=$(date +%s)
  echo "== $name"
  "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    rows+=("$name|pass|$(( $(date +%s) - t0 ))")
  else
    rows+=("$name|FAIL|$(( $(date +%s) - t0 ))")
    failed=$((failed + 1))
    echo "   FAILED (exit $rc); the end of $LOGS/$name.log:"
    tail -n 25 "$LOGS/$name.log" | sed 's/^/   | /'
  fi
  return $rc
}
skip() { rows+=("$1|skip: $2|0"); echo "== $1: skipped ($2)"; }

# --- the machine: packages, podman's configuration ------------------------------------------------------------------
install_packages() {
  local want=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs chromium) missing=()
  for p in "${want[@]}"; do dpkg -s "$p" > /dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} = 0 ] && { echo "installed already: ${want[*]}"; return 0; }
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

configure_podman() {
  # runc, cgroupfs, no default ulimits or pids limit: what this kind of kernel and cgroup v1 host accept
  cat > "$CONTAINERS_CONF" <<EOF
[containers]
default_ulimits = []
pids_limit = 0
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  cat > "$CONTAINERS_STORAGE_CONF" <<EOF
[storage]
driver = "${IMAGES_STORAGE_DRIVER:-overlay}"
graphroot = "$CACHE/storage"
runroot = "/run/course-images"
EOF
  podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Store.GraphDriverName}}'
}

# --- the stand-in bases -----------------------------------------------------------------------------------------------
rootfs() {
  if podman image exists "$ROOTFS_IMAGE"; then echo "$ROOTFS_IMAGE exists"; return 0; fi
  local dir="$CACHE/rootfs-${ROOTFS_IMAGE##*:}"
  if [ ! -e "$dir/.complete" ]; then
    rm -rf "$dir"
    debootstrap --variant=minbase --include="$ROOTFS_PACKAGES" bookworm "$dir" \
      "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" || return 1
    touch "$dir/.complete"
  fi
  # this machine's own certificate authorities (a TLS-intercepting proxy in front of PyPI, say): the stand-ins trust
  # them, as the host does (the stand-in Containerfiles point pip at the system bundle)
  if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/"
    chroot "$dir" update-ca-certificates
  fi
  tar -C "$dir" --exclude=./.complete -c . | podman import --change 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE"
}

torch_wheel() {
  mkdir -p "$CACHE/wheels"
  ls "$CACHE"/wheels/torch-*-cp311-*.whl > /dev/null 2>&1 && { ls "$CACHE"/wheels/; return 0; }
  # pip's own configuration finds it (a wheel on this disk, or the index); Debian bookworm's Python is 3.11
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 -d "$CACHE/wheels" "$TORCH_WHEEL_SPEC" \
    && ls "$CACHE"/wheels/torch-*-cp311-*.whl
}

standin() {  # standin ngc|primus
  podman build --format docker --network host --layers -f "docker/standin/Containerfile.$1" --build-arg "ROOTFS=$ROOTFS_IMAGE" \
    -t "localhost/course-standin-$1:latest" "$CACHE/wheels"
}

# --- the workshop images --------------------------------------------------------------------------------------------
image_tag() { echo "localhost/scaling-pytorch-course:$1-standin${2:+-$2}"; }  # flavour [grader]
vendor_of() { [ "$1" = cuda ] && echo ngc || echo primus; }

build() {  # build FLAVOUR student|grader
  local flavour="$1" target="$2" log
  # --format docker: OCI's image format has no SHELL, and the Dockerfiles' RUNs need bash -o pipefail
  podman build --format docker --network host --layers -f "docker/Dockerfile.$flavour" --ignorefile "docker/Dockerfile.$flavour.dockerignore" \
    --build-arg "BASE_IMAGE=localhost/course-standin-$(vendor_of "$flavour"):latest" --build-arg STANDIN_BASE=1 \
    --target "$target" -t "$(image_tag "$flavour" "$([ "$target" = grader ] && echo grader)")" . || return 1
  # the skips said so (a cached layer prints nothing: its first build's log has them)
  log="$LOGS/build-$flavour-$target.log"
  grep -c "STANDIN_BASE=1: SKIPPED" "$log" || true
}

student_layers() {  # no layer of the student image ever held the instructor's files
  podman save --format docker-archive "$(image_tag "$1")" | "$PY" docker/images_check.py scan-student
}

student_lab() {  # docker/run.sh starts the student image; the browser validates notebook 00; the instructor is refused
  local flavour="$1" port="$2" work name="images-check-$1-student"
  work="$(mktemp -d "$CACHE/work-$flavour-XXXX")"
  chown 1000:1000 "$work"  # the image's student (NB_UID 1000) writes there
  podman rm -f "$name" > /dev/null 2>&1
  CONTAINER_ENGINE=podman JUPYTER_TOKEN="images-check-$flavour-token" \
    docker/run.sh "$flavour" --no-gpus --image "$(image_tag "$flavour")" --name "$name" --port "$port" --work "$work" \
    --shm-size 2G || return 1
  "$PY" docker/images_check.py student-lab --engine podman --container "$name" --work "$work" \
    --url "http://127.0.0.1:$port" --token "images-check-$flavour-token" --tag "$flavour"
  local rc=$?
  podman logs "$name" > "$LOGS/lab-$flavour-student.container.log" 2>&1
  [ "${IMAGES_CHECK_KEEP:-0}" = 1 ] || { podman rm -f "$name" > /dev/null 2>&1; rm -rf "$work"; }
  [ $rc = 0 ] || return $rc
  # the student image refuses the instructor's role, naming the grader image
  local out
  out="$(podman run --rm -e COURSE_ROLE=instructor "$(image_tag "$flavour")" 2>&1)" && { echo "$out"; return 1; }
  echo "$out"
  grep -q -- "-grader" <<< "$out"
}

grader_grades() {  # nbgrader autograde in the grader image, as its user: a solution scores full marks, a stub less
  podman run --rm --network none -v "$ROOT/docker/images_check.py:/tmp/images_check.py:ro" \
    --entrypoint /opt/course/.venv/bin/python "$(image_tag "$1" grader)" /tmp/images_check.py grade 00_orientation
}

# --- the run ------------------------------------------------------------------------------------------------------------
step install install_packages || exit 1
step configure configure_podman || exit 1
step rootfs rootfs || exit 1
step torch-wheel torch_wheel || exit 1
port=$PORT_BASE
for flavour in $FLAVOURS; do
  vendor="$(vendor_of "$flavour")"
  if ! step "standin-$vendor" standin "$vendor"; then continue; fi
  if step "build-$flavour-student" build "$flavour" student; then
    step "student-layers-$flavour" student_layers "$flavour"
    step "student-lab-$flavour" student_lab "$flavour" "$port"
  else
    skip "student-$flavour" "its build failed"
  fi
  if step "build-$flavour-grader" build "$flavour" grader; then
    step "grader-grades-$flavour" grader_grades "$flavour"
  else
    skip "grader-grades-$flavour" "its build failed"
  fi
  port=$((port + 1))
done

# a rebuild leaves the layers it replaced: only the current images and their build cache stay
podman image prune -f > /dev/null 2>&1

printf '\n%-28s %-8s %8s\n' step result seconds
for row in "${rows[@]}"; do
  IFS='|' read -r name status secs <<< "$row"
  printf '%-28s %-8s %8s\n' "$name" "$status" "$secs"
done
printf '%-28s %-8s %8s\n' total "$([ $failed = 0 ] && echo pass || echo "FAIL($failed)")" "$(( $(date +%s) - t_all ))"
echo "logs: $LOGS; screenshots: runs/test-artifacts/browser_images-check-*.png; podman's images and the stand-in folder: $CACHE (delete it to start from nothing)"
[ $failed = 0 ]
