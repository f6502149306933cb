#!/usr/bin/env bash
# Make (once, then reuse) a Debian bookworm base image in the test's buildah store and print its
# name. It stands in for python:3.11-slim-bookworm, which cannot be pulled here: same Debian
# release, same Python minor (3.11), with python3-venv so the Dockerfile's `python3 -m venv` works.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/image/env.sh
. "$here/env.sh"

SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The tag changes whenever this recipe does, so a stale base is never reused.
tag=$SUITE-$(printf '%s\n' "$SUITE" "$PACKAGES" "$(sed -n '/^base_image()/,/^}/p' "$0")" | sha256sum | cut -c1-12)
image=$BASE_REPO:$tag

rootfs=
ctr=
cleanup() {
    if [ -n "$rootfs" ]; then
        # debootstrap leaves /proc, /sys mounted inside the target when it fails half-way.
        findmnt -rn -o TARGET | grep -F "$rootfs/" | sort -r | xargs -r -n1 umount -l || true
        rm -rf --one-file-system "$rootfs"
    fi
    [ -z "$ctr" ] || bah rm "$ctr" >/dev/null || true
    remove_created_globals
}
trap cleanup EXIT

base_image() {
    local mnt
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    echo "base: debootstrap $SUITE ($PACKAGES) from $MIRROR" >&2
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >&2
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    ctr=$(bah from scratch)
    mnt=$(bah mount "$ctr")
    cp -a "$rootfs"/. "$mnt"/
    bah umount "$ctr" >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    bah commit --quiet "$ctr" "$image" >/dev/null
}

if ! bah inspect --type image "$image" >/dev/null 2>&1; then
    base_image
    # Older recipes' bases only take space now.
    for old in $(bah images --format '{{.Name}}:{{.Tag}}'); do
        [ "${old%%:*}" != "$BASE_REPO" ] || [ "$old" = "$image" ] || bah rmi "$old" >&2 || true
    done
fi
echo "$image"
