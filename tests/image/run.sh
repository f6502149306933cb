#!/usr/bin/env bash
# The real image test (`make image-test`): build docker/Dockerfile with buildah, exactly as written,
# on a debootstrap Debian bookworm base (build.sh), then run the smoke job inside the image, with
# buildah and with podman.
#
# Proves: the Dockerfile builds (multi-stage, cache and secret mounts, the .dockerignore allowlist);
# pyproject's pins install from requirements.lock, and torch really reports the CUDA and NCCL
# versions the labels claim (the build checks both itself); the image runs as uid 10001 with
# `python`, `harness` and the locked `py-spy` on PATH; `harness launch jobs/smoke.yaml` (2 nodes,
# gloo, CPU) succeeds inside it; no build-time pip setting, CA bundle or local index is left in it.
# Cannot prove: anything about python:3.11-slim-bookworm itself (it cannot be pulled here; the base
# is swapped through the BASE build arg), GPUs, the NVIDIA container toolkit or NCCL traffic.
#
# Needs root and the Debian packages buildah, debootstrap, podman (runc, conmon, catatonit) and iproute2. Cache:
# /var/tmp/harness-image-cache (HARNESS_IMAGE_CACHE): the base and the layers, kept for fast reruns.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=tests/image/env.sh
. "$here/env.sh"
PYTHON=${PYTHON:-$repo/.venv/bin/python}

for tool in buildah debootstrap podman unshare ip; do
    command -v "$tool" >/dev/null || {
        echo "image-test: $tool is missing (make test-packages; apt-get install iproute2)" >&2
        exit 1
    }
done

work=$(mktemp -d)
ctr=
base_ctr=
podman_state=
cleanup() {
    for c in "$ctr" "$base_ctr"; do
        [ -z "$c" ] || bah rm "$c" >/dev/null 2>&1 || true
    done
    rm -rf "$work"
    [ -z "$podman_state" ] || rm -rf "$podman_state"
    remove_created_globals
}
trap cleanup EXIT

"$here/build.sh"
base=$("$here/base.sh")
pip_lines=$("$PYTHON" "$here/pipconf.py" "$work/pip.conf")
mapfile -t pip_args <<<"$pip_lines"

passed=0
failed=0
check() {
    local name=$1
    shift
    if "$@"; then
        echo "image-test: ok: $name"
        passed=$((passed + 1))
    else
        echo "image-test: FAILED: $name"
        failed=$((failed + 1))
    fi
}

in_image() {
    bah run "${RUN_FLAGS[@]}" "$ctr" -- "$@"
}

# The image's config as an engine's inspect shows it (JSON on stdin; $1: where the config is in it).
config_matches_the_pins() {
    "$PYTHON" -c '
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/docker")
import pins
config = json.load(sys.stdin)
for key in sys.argv[2].split("."):
    config = config[int(key) if key.isdigit() else key]
labels = config["Labels"]
lock = pins.read_lock(Path(sys.argv[1]) / "requirements.lock")
expected = {"harness." + arg.removesuffix("_VERSION").lower(): value
            for arg, value in pins.expected_labels(lock).items()} | {"harness.python": "3.11"}
wrong = {key: (labels.get(key), value) for key, value in expected.items() if labels.get(key) != value}
assert not wrong, f"labels (found, expected): {wrong}"
assert config["User"] == "10001:10001" and config["Entrypoint"] == ["harness"], config
assert config["WorkingDir"] == "/workspace", config
' "$repo" "$1"
}

labels_and_config() {
    bah inspect --type image "$IMAGE" | config_matches_the_pins OCIv1.config
}

user_and_path() {
    [ "$(in_image sh -c 'id -u; command -v python; command -v harness; pwd; test -w . && echo writable')" \
        = "$(printf '10001\n/opt/venv/bin/python\n/opt/venv/bin/harness\n/workspace\nwritable')" ]
}

# buildah leaves an empty directory where a --volume was mounted; anything more would be a leak.
nothing_of_the_build_left() {
    local leftovers
    leftovers=(/etc/pip.conf /run/secrets /root/.cache/pip /src /opt/build /dist)
    for ((i = 0; i < ${#pip_args[@]}; i += 2)); do
        [ "${pip_args[i]}" != --volume ] || leftovers+=("${pip_args[i + 1]%%:*}")
    done
    # shellcheck disable=SC2016  # the script expands its own arguments, inside the image
    bah run "${RUN_FLAGS[@]}" --user 0:0 "$ctr" -- sh -c '
        for path; do
            if [ -e "$path" ] && [ -n "$(ls -A "$path")" ]; then echo "left in the image: $path"; exit 1; fi
        done' sh "${leftovers[@]}"
}

base_ca_bundle_intact() {
    local bundle=/etc/ssl/certs/ca-certificates.crt
    base_ctr=$(bah from --pull=never "$base")
    [ "$(in_image sha256sum "$bundle")" = "$(bah run --isolation chroot "$base_ctr" -- sha256sum "$bundle")" ]
}

cli_and_pod() {
    in_image harness --version && in_image python -m harness.node.pod --help >/dev/null
}

# py-spy, pinned like every dependency, beside the image's python (where the node agent looks for it first).
py_spy_beside_python() {
    [ "$(in_image sh -c 'command -v py-spy; py-spy --version')" \
        = "$(printf '/opt/venv/bin/py-spy\npy-spy %s' "$(sed -n 's/^py-spy==//p' "$repo/requirements.lock")")" ]
}

# In a private network namespace (loopback only) the job's fixed master_port 29500 cannot collide
# with anything else on this machine, and nothing can leave it.
smoke_job() {
    local start=$SECONDS
    unshare --net sh -c 'ip link set lo up && exec "$@"' sh "${BUILDAH[@]}" run "${RUN_FLAGS[@]}" "$ctr" -- \
        sh -c 'harness launch jobs/smoke.yaml && cat runs/*/summary.json' | tee "$work/smoke.log"
    echo "image-test: the smoke job took $((SECONDS - start)) s"
    grep -q '"status": "succeeded"' "$work/smoke.log"
}

# A hostname that resolves, as docker and Kubernetes give every container. Without one gloo falls
# back to loopback with a warning, and here about 1 run in 6 then has a rank abort at exit
# ("terminate called without an active exception").
RUN_FLAGS=(--isolation chroot --hostname harness-node)
ctr=$(bah from --pull=never --add-host harness-node:127.0.0.1 --name "harness-image-test-$$" "$IMAGE")
check "labels equal the pins in requirements.lock; user 10001:10001, entrypoint harness" labels_and_config
check "runs as uid 10001 in a writable /workspace; python and harness from /opt/venv" user_and_path
check "no pip config, secret, pip cache, local index or build tree left in the image" nothing_of_the_build_left
check "the base's own CA bundle is untouched by the build's cacert secret" base_ca_bundle_intact
check "harness --version and python -m harness.node.pod run" cli_and_pod
check "py-spy --version: the locked py-spy in /opt/venv/bin, beside python" py_spy_beside_python
check "harness launch jobs/smoke.yaml (2 nodes, gloo) succeeds inside the image" smoke_job

# The same image under podman, an engine users have: state of its own at a short path (podman 4.3
# wants a runroot under 50 characters), the build's store as a read-only image store; the settings
# are the namespace hosts' (testbed/podman_config.py says why each is needed on this machine).
podman_state=$(mktemp -d /tmp/hxpodman.XXXXXX)
"$PYTHON" "$repo/testbed/podman_config.py" "$podman_state" "$CACHE/storage"
export CONTAINERS_CONF=$podman_state/containers.conf CONTAINERS_STORAGE_CONF=$podman_state/storage.conf \
    CONTAINERS_REGISTRIES_CONF=$podman_state/registries.conf

podman_inspect() {
    podman image inspect "$IMAGE" | config_matches_the_pins 0.Config
}

podman_user() {
    [ "$(podman run --rm --entrypoint id "$IMAGE" -u)" = 10001 ]
}

# `podman run --rm IMAGE launch jobs/smoke.yaml`, as a user types it, in a private network namespace.
podman_smoke() {
    local start=$SECONDS
    unshare --net sh -c 'ip link set lo up && exec "$@"' sh podman run --rm --network=host \
        --hostname harness-node --add-host harness-node:127.0.0.1 "$IMAGE" launch jobs/smoke.yaml \
        | tee "$work/podman-smoke.log"
    local code=${PIPESTATUS[0]}
    echo "image-test: the smoke job under podman took $((SECONDS - start)) s"
    [ "$code" = 0 ] && grep -q "harness: run .* succeeded" "$work/podman-smoke.log" \
        && [ -z "$(podman ps --all --quiet)" ]
}

# As the rendered Kubernetes pods run (harness/targets/k8s/objects.py hardened): the root file system read-only, an
# emptyDir (a directory of mode 0777, as the kubelet makes one) at /tmp and at HOME, the job's volume at /workspace.
podman_read_only_root() {
    local pod=$work/pod
    mkdir -p "$pod/tmp" "$pod/home" "$pod/workspace"
    cp -r "$repo/jobs" "$pod/workspace/"
    chmod 0777 "$pod/tmp" "$pod/home" "$pod/workspace"
    unshare --net sh -c 'ip link set lo up && exec "$@"' sh podman run --rm --network=host \
        --hostname harness-node --add-host harness-node:127.0.0.1 --read-only --read-only-tmpfs=false \
        -v "$pod/tmp:/tmp" -v "$pod/home:/home/harness" -e HOME=/home/harness -v "$pod/workspace:/workspace" \
        "$IMAGE" launch jobs/smoke.yaml | tee "$work/read-only-smoke.log"
    [ "${PIPESTATUS[0]}" = 0 ] && grep -q "harness: run .* succeeded" "$work/read-only-smoke.log" \
        && ! grep -q "cannot register run" "$work/read-only-smoke.log" \
        && ! podman run --rm --read-only --read-only-tmpfs=false --entrypoint touch "$IMAGE" /opt/venv/x 2>/dev/null
}

check "podman image inspect: labels equal the pins; user 10001:10001, entrypoint harness" podman_inspect
check "podman run: the image's default user is uid 10001" podman_user
check "podman run --rm IMAGE launch jobs/smoke.yaml exits 0 and leaves no container" podman_smoke
check "the smoke job runs as the pods do: a read-only root, /tmp and HOME emptyDirs" podman_read_only_root
echo "image-test: $passed passed, $failed failed"
[ "$failed" = 0 ]
