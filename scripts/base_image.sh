#!/usr/bin/env bash
# Makes the base image the Dockerfiles build FROM on a host that cannot pull from any registry:
#   ${EMBEDMESH_BASE_IMAGE:-localhost/embedmesh/python:3.11-slim-bookworm}
# a Debian 12 (bookworm) minbase root filesystem made by debootstrap from the Debian mirror, with Debian's
# python3 (3.11) made to behave like the official python:3.11-slim-bookworm image: a virtual environment at
# /usr/local, so `python`, `python3` and `pip` in /usr/local/bin install into /usr/local/lib/python3.11/site-packages
# (no PEP 668 refusal; Debian's own /usr/bin/python3 stays untouched), and the C headers (python3-dev) that
# sdists such as hnswlib compile against, as in the official image. The root filesystem is cached as a tarball
# under ${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}/images/, so a rerun only imports it (seconds); an existing
# image of that name makes the script a no-op. Needs root, debootstrap and podman.
set -euo pipefail

CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
IMAGE="${EMBEDMESH_BASE_IMAGE:-localhost/embedmesh/python:3.11-slim-bookworm}"
MIRROR="${EMBEDMESH_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TARBALL="$CACHE/images/bookworm-python3.11-rootfs.tar"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$(cd "$(dirname "$0")/.." && pwd)/deploy/podman/containers.conf}"
step() { echo "[base-image] $(date +%H:%M:%S) $*"; }

if podman image exists "$IMAGE"; then
  step "reusing $IMAGE"
  exit 0
fi
if [[ ! -f "$TARBALL" ]]; then
  ROOTFS="$(mktemp -d /var/tmp/embedmesh-rootfs.XXXXXX)"
  trap 'umount "$ROOTFS/proc" 2>/dev/null || true; rm -rf "$ROOTFS"' EXIT
  step "debootstrap --variant=minbase bookworm from $MIRROR"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$ROOTFS" "$MIRROR" \
    >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log"; exit 1; }
  rm -f "$ROOTFS.log"
  step "a virtual environment at /usr/local (pip without PEP 668's refusal, as in the official image)"
  mount -t proc proc "$ROOTFS/proc"
  chroot "$ROOTFS" /usr/bin/python3 -m venv /usr/local
  umount "$ROOTFS/proc"
  # What the official slim image leaves out too: package lists and caches.
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb
  mkdir -p "$CACHE/images"
  tar -C "$ROOTFS" --numeric-owner -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
fi
step "podman import $TARBALL as $IMAGE"
podman import --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' --quiet "$TARBALL" "$IMAGE" >/dev/null
podman run --rm --pull=never "$IMAGE" python3 -c 'import sys, ssl; assert sys.prefix == "/usr/local", sys.prefix'
step "done: $IMAGE"
