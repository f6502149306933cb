# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this file
# Sourced by the image-test scripts: one private buildah store, so the test never touches the
# machine's own image store, and its cache (the debootstrap base, the dependency layer) survives
# between runs. `rm -rf /var/tmp/harness-image-cache` resets it (no mount outlives a run).

CACHE=${HARNESS_IMAGE_CACHE:-/var/tmp/harness-image-cache}
# buildah keeps RUN --mount=type=cache directories (the pip cache) under $TMPDIR.
export TMPDIR="$CACHE/tmp"
mkdir -p "$TMPDIR"
# The test base: Debian bookworm with its Python 3.11, made by debootstrap (base.sh).
BASE_REPO=localhost/harness-image-test-base
# What build.sh makes from docker/Dockerfile.
IMAGE=localhost/harness:image-test

BUILDAH=(buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay)
bah() {
    "${BUILDAH[@]}" "$@"
}

# buildah also creates a few machine-wide folders on first use (its blob-info cache, network
# config): each script removes at its end those that did not exist when it started.
created_globals=()
for path in /var/lib/containers /etc/containers/networks /run/containers; do
    [ -e "$path" ] || created_globals+=("$path")
done
remove_created_globals() {
    rm -rf "${created_globals[@]}"
}
