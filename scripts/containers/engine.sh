#!/usr/bin/env bash
# Sourced by scripts/build_image.sh, scripts/containers/play_chart.py and bench/containers.py:
# the container engine (podman, or buildah for builds only) with the settings hosts like ours
# need.
#
# On a host whose cgroups are mounted in hybrid mode (/sys/fs/cgroup/unified exists), podman's
# default OCI runtime crun refuses to start a container ("cgroups in hybrid mode not
# supported") and its default ulimits cannot be set (setrlimit: Operation not permitted), so
# there we run podman with runc, cgroupfs and a containers.conf with no default ulimits.
# ANCE_CONTAINER_COMPAT=1 forces those settings, =0 turns them off. The storage driver is
# overlay (ANCE_STORAGE_DRIVER=vfs where the kernel has no overlayfs: it works everywhere but
# copies the whole image for every container, about 20 s and 2 GB per start of ance-train's).
# docs/deployment.md, section 9, lists the failures these settings answer.
set -euo pipefail

ance_engine_compat() {
  case "${ANCE_CONTAINER_COMPAT:-auto}" in
    1) return 0 ;;
    0) return 1 ;;
    *) [[ -d /sys/fs/cgroup/unified ]] ;;
  esac
}

ENGINE_FLAGS=()
if ance_engine_compat; then
  ENGINE_FLAGS=(--storage-driver "${ANCE_STORAGE_DRIVER:-overlay}" --runtime runc
                --cgroup-manager cgroupfs)
  if [[ -z "${CONTAINERS_CONF:-}" ]]; then
    CONTAINERS_CONF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/containers.conf"
    export CONTAINERS_CONF
  fi
fi

# podman with the flags above: `engine run ...`, `engine build ...`, `engine kube play ...`.
engine() {
  podman "${ENGINE_FLAGS[@]}" "$@"
}
