#!/usr/bin/env bash
# Build docker/Dockerfile with buildah, exactly as written, on the debootstrap Debian bookworm base,
# into the test store (env.sh), as localhost/harness:image-test. Used by `make image-test` (run.sh)
# and by the container tests of `make test`, whose namespace hosts run this store's image with
# podman. ~7 min cold, seconds warm (the layer cache).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=tests/image/env.sh
. "$here/env.sh"
PYTHON=${PYTHON:-$repo/.venv/bin/python}

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || {
        echo "image build: $tool is missing (apt-get install buildah debootstrap)" >&2
        exit 1
    }
done

work=$(mktemp -d)
cleanup() {
    rm -rf "$work"
    remove_created_globals
}
trap cleanup EXIT

base=$("$here/base.sh")
pip_lines=$("$PYTHON" "$here/pipconf.py" "$work/pip.conf")
mapfile -t pip_args <<<"$pip_lines"

echo "image build: docker/Dockerfile on $base"
start=$SECONDS
bah bud --isolation chroot --layers --force-rm --pull=never \
    -f "$repo/docker/Dockerfile" --ignorefile "$repo/docker/Dockerfile.dockerignore" \
    --build-arg "BASE=$base" "${pip_args[@]}" -t "$IMAGE" "$repo"
echo "image build: took $((SECONDS - start)) s; image size $(bah images --format '{{.Size}}' "$IMAGE")"
