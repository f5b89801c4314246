#!/usr/bin/env bash
# Install the container engine the image builds and tests use: podman and buildah, the runc
# runtime, and mmdebstrap for the Debian base image (scripts/build_image.sh). Debian/Ubuntu
# packages; does nothing when they are already installed. Run as root (or with sudo).
set -euo pipefail
needed=()
for tool in podman buildah runc mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 || needed+=("$tool")
done
if [[ ${#needed[@]} -eq 0 ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install_engine.sh: ${needed[*]} missing; run as root or: sudo apt-get install -y ${needed[*]}" >&2
  exit 2
fi
echo "installing ${needed[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq podman buildah runc mmdebstrap >/dev/null
