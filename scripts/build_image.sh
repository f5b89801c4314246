#!/usr/bin/env bash
# Build ance-train's container images with podman (buildah underneath): no Docker daemon.
#
#   bash scripts/build_image.sh cpu      docker/Dockerfile.cpu -> ance-train:<version>-cpu
#   bash scripts/build_image.sh gpu      docker/Dockerfile     -> ance-train:<version>
#   bash scripts/build_image.sh redis    docker/Dockerfile.redis -> ance-train-redis:<version>
#   bash scripts/build_image.sh s3       docker/Dockerfile.s3    -> ance-train-s3:<version>
#   bash scripts/build_image.sh base     only the Debian base (below)
#
# The Dockerfiles are the standard ones (`docker build -f docker/Dockerfile.cpu .` works as
# well). Their base image is a build argument (PYTHON_IMAGE, CUDA_IMAGE). When that base cannot
# be pulled (no registry reachable), a base made from Debian packages stands in for it:
# mmdebstrap lays a Debian bookworm root file system with python3, pip and libgomp1, arranged
# as python:3.11-slim is (`python` and `pip` on PATH, pip installing system-wide), and podman
# imports it as localhost/ance-base:bookworm. The redis and s3 images always build on it: they
# exist for engines without a registry (scripts/containers/play_chart.sh); a cluster uses the
# chart's own Redis/MinIO images or external services.
#
# Environment:
#   BASE_IMAGE     use this base instead (skips the pull and the Debian base)
#   TAG            image tag (default: the package version)
#   LOCAL_WHEELS   a folder of wheels pip may take packages from during the build (find-links),
#                  e.g. a CPU build of torch, which otherwise comes from the default index with
#                  the CUDA libraries (several GB). Mounted read-only; nothing of it is copied
#                  into a layer but the installed packages. Default: /opt/wheels when it exists.
#   PIP_CONF_DIR   a pip configuration folder mounted at /etc/xdg/pip during the build (a
#                  mirror, a constraint file); default: /etc/xdg/pip when it exists.
#   TORCH_INDEX_URL, TORCH_SPEC, FAISS_GPU_SPEC   passed to the Dockerfiles as build arguments.
# Build time, each Dockerfile step's time and the image size are printed at the end and
# written to build/images/<target>.json (NO_CACHE=1: build every step again).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/containers/engine.sh
. scripts/containers/engine.sh

target="${1:-cpu}"
version="$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
tag="${TAG:-$version}"
debian_base="localhost/ance-base:bookworm"
mkdir -p build/images

build_debian_base() {
  if engine image exists "$debian_base"; then
    return
  fi
  command -v mmdebstrap >/dev/null || {
    echo "build_image.sh: mmdebstrap is needed for the Debian base (apt-get install mmdebstrap)" >&2
    exit 2
  }
  local tar
  tar="$(mktemp -d)/rootfs.tar"
  echo "building the Debian base $debian_base (mmdebstrap, bookworm)"
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,libgomp1 \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    --customize-hook='ln -sf /usr/bin/python3 "$1"/usr/local/bin/python' \
    --customize-hook='ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tar"
  engine import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "$tar" "$debian_base" >/dev/null
  rm -rf "$(dirname "$tar")"
}

# The base for a Dockerfile: BASE_IMAGE, else the Dockerfile's default when it can be pulled,
# else the Debian base.
choose_base() {
  local dockerfile="$1" arg="$2" default
  if [[ -n "${BASE_IMAGE:-}" ]]; then
    echo "$BASE_IMAGE"
    return
  fi
  default="$(sed -n "s/^ARG ${arg}=//p" "$dockerfile")"
  if engine image exists "$default" || engine pull -q "$default" >/dev/null 2>&1; then
    echo "$default"
  else
    echo "base image $default cannot be pulled: using the Debian base $debian_base" >&2
    build_debian_base >&2
    echo "$debian_base"
  fi
}

build_args=()
for name in TORCH_INDEX_URL TORCH_SPEC FAISS_GPU_SPEC; do
  if [[ -n "${!name:-}" ]]; then
    build_args+=(--build-arg "$name=${!name}")
  fi
done
# What the build may read from the host (read-only): CA certificates, pip's configuration and
# a folder of wheels. The build's RUN steps use the host's network: on podman's default bridge
# network a build container could not resolve host names here.
volumes=(--volume /etc/ssl/certs:/etc/ssl/certs:ro)
pip_conf_dir="${PIP_CONF_DIR:-/etc/xdg/pip}"
if [[ -d "$pip_conf_dir" ]]; then
  volumes+=(--volume "$pip_conf_dir:/etc/xdg/pip:ro")
fi
local_wheels="${LOCAL_WHEELS:-/opt/wheels}"
if [[ -d "$local_wheels" ]]; then
  # pip reads /etc/pip.conf after /etc/xdg/pip/pip.conf; the file exists only during the build.
  pip_find_links="$(mktemp)"
  trap 'rm -f "$pip_find_links"' EXIT
  printf '[global]\nfind-links = /opt/local-wheels\n' >"$pip_find_links"
  volumes+=(--volume "$local_wheels:/opt/local-wheels:ro" --volume "$pip_find_links:/etc/pip.conf:ro")
fi

case "$target" in
  cpu)
    dockerfile=docker/Dockerfile.cpu image="ance-train:${tag}-cpu"
    base_arg=PYTHON_IMAGE ;;
  gpu)
    dockerfile=docker/Dockerfile image="ance-train:${tag}"
    base_arg=CUDA_IMAGE ;;
  redis)
    dockerfile=docker/Dockerfile.redis image="ance-train-redis:${tag}" base_arg=BASE_IMAGE ;;
  s3)
    dockerfile=docker/Dockerfile.s3 image="ance-train-s3:${tag}" base_arg=BASE_IMAGE ;;
  base)
    build_debian_base
    engine image ls "$debian_base"
    exit 0 ;;
  *)
    echo "usage: bash scripts/build_image.sh cpu|gpu|redis|s3|base" >&2
    exit 2 ;;
esac

case "$target" in
  redis | s3) base="${BASE_IMAGE:-$debian_base}"; [[ -n "${BASE_IMAGE:-}" ]] || build_debian_base ;;
  *) base="$(choose_base "$dockerfile" "$base_arg")" ;;
esac

echo "building $image from $dockerfile on $base"
start=$(date +%s)
# Each output line is stamped, so that the time of every Dockerfile step can be reported.
log="build/images/$target.log"
cache=(--layers)
[[ "${NO_CACHE:-0}" == 1 ]] && cache=(--no-cache)
engine build --network host "${cache[@]}" -f "$dockerfile" -t "$image" \
  --build-arg "$base_arg=$base" "${build_args[@]}" "${volumes[@]}" . 2>&1 \
  | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done \
  | tee "$log" | cut -d' ' -f2-
[[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "build of $image failed: $log" >&2; exit 1; }
seconds=$(( $(date +%s) - start ))
size=$(engine image inspect --format '{{.Size}}' "$image")
IMAGE="$image" DOCKERFILE="$dockerfile" BASE="$base" SECONDS_="$seconds" SIZE="$size" \
  LOG="$log" python3 - <<'PY' | tee "build/images/$target.json"
import json, os, re
steps, current = [], None
for line in open(os.environ["LOG"], encoding="utf-8", errors="replace"):
    stamp, _, text = line.rstrip("\n").partition(" ")
    if re.match(r"STEP \d+/\d+: ", text):
        if current:
            current["seconds"] = round(float(stamp) - current.pop("start"), 1)
            steps.append(current)
        current = {"step": text.split(": ", 1)[1][:90], "start": float(stamp)}
    last = stamp
if current:
    current["seconds"] = round(float(last) - current.pop("start"), 1)
    steps.append(current)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
            if l.startswith("model name")), "")
print(json.dumps({"image": os.environ["IMAGE"], "dockerfile": os.environ["DOCKERFILE"],
                  "base": os.environ["BASE"], "build_seconds": int(os.environ["SECONDS_"]),
                  "size_bytes": int(os.environ["SIZE"]), "steps": steps,
                  "date": __import__("time").strftime("%Y-%m-%dT%H:%M:%SZ",
                                                      __import__("time").gmtime()),
                  "host_cpu": cpu}))
PY
echo "built $image in ${seconds}s, $(( size / 1000000 )) MB (steps: build/images/$target.json)"
