#!/bin/sh
# make image: build the Containerfile into $IMAGE ($1, e.g. envoy-llm-admission:0.1.0).
#
# Works without Docker: buildah, chroot isolation and the vfs storage driver run in an
# unprivileged build sandbox. The base is $IMAGE_BASE when given (a Python 3.11 image from a
# registry, e.g. docker.io/library/python:3.11-slim-bookworm); without it, and with no
# registry reachable, a Debian bookworm root filesystem with Python 3.11 is made by mmdebstrap
# from the Debian mirror and imported once as $BASE_NAME. The wheels of the runtime
# dependencies are collected here first, at the versions in constraints.txt, so the build
# itself needs no network. On a workstation `docker build -f Containerfile .` builds the same
# file (it installs from PyPI when .image-wheels/ is absent).
set -eu
IMAGE=${1:?usage: scripts/image.sh NAME:TAG}
PY=${PY:-.venv/bin/python}
BUILDAH="buildah --storage-driver ${STORAGE_DRIVER:-vfs}"
BASE_NAME=localhost/envoy-llm-admission-base:bookworm

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing: $1 -- apt-get install -y $2" >&2; exit 1; }; }
need buildah buildah

base=${IMAGE_BASE:-}
if [ -z "$base" ]; then
    base=$BASE_NAME
    if ! $BUILDAH inspect --type image "$base" >/dev/null 2>&1; then
        need mmdebstrap mmdebstrap
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        echo "base: mmdebstrap bookworm (python3.11) -> $base"
        mmdebstrap --quiet --variant=minbase \
            --include=python3.11,python3.11-venv,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
            bookworm "$tmp/rootfs.tar"
        ctr=$($BUILDAH from scratch)
        $BUILDAH add "$ctr" "$tmp/rootfs.tar" /
        $BUILDAH config --env LANG=C.UTF-8 --cmd /bin/sh "$ctr"
        $BUILDAH commit --rm "$ctr" "$base"
    fi
fi

echo "wheels: runtime dependencies at constraints.txt -> .image-wheels/"
rm -rf .image-wheels build  # build/: setuptools' folder, which keeps files deleted since
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's is 3.11.2), which the
# interpreter collecting the wheels may not be
"$PY" -m pip wheel --quiet --wheel-dir .image-wheels -c constraints.txt . async-timeout 2>&1 \
    | grep -v "^WARNING: Location" || true
ls .image-wheels/envoy_llm_admission-*.whl >/dev/null

echo "image: $IMAGE from $base"
$BUILDAH build --isolation chroot --layers=false --build-arg "BASE=$base" \
    -f Containerfile -t "$IMAGE" .
