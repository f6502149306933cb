#!/usr/bin/env bash
# Build or push the image with the container engine this machine has: docker (when its daemon
# answers), else podman, else buildah; ENGINE=... picks one. `make image` / `make push` call this.
#   docker/image.sh build REF [build flags...]   e.g. --build-arg BASE=... --secret id=pipconf,src=...
#   docker/image.sh push REF
# The context is the repository root; docker/Dockerfile.dockerignore keeps it to what the image needs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

engine() {
    if [ -n "${ENGINE:-}" ]; then
        echo "$ENGINE"
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v buildah >/dev/null; then
        echo buildah
    else
        echo "docker/image.sh: no container engine: install docker, podman or buildah" >&2
        return 1
    fi
}

[ $# -ge 2 ] || { sed -n '2,6p' "$0" >&2; exit 2; }
verb=$1 ref=$2
shift 2
tool=$(engine)
case "$verb:$tool" in
    build:docker)
        # BuildKit reads docker/Dockerfile.dockerignore by itself (the Dockerfile's name + .dockerignore).
        exec docker build -f "$repo/docker/Dockerfile" -t "$ref" "$@" "$repo" ;;
    build:podman)
        exec podman build --layers --ignorefile "$repo/docker/Dockerfile.dockerignore" \
            -f "$repo/docker/Dockerfile" -t "$ref" "$@" "$repo" ;;
    build:buildah)
        exec buildah bud --layers --force-rm --ignorefile "$repo/docker/Dockerfile.dockerignore" \
            -f "$repo/docker/Dockerfile" -t "$ref" "$@" "$repo" ;;
    push:*)
        exec "$tool" push "$ref" ;;
    *)
        echo "docker/image.sh: unknown verb $verb (build or push)" >&2
        exit 2 ;;
esac
