# The verbs users type. `make setup` once on a fresh machine, then `make test` / `make launch`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# System packages the tests need: sshd, network namespaces and firewalls for the multi-host cluster.
APT_PACKAGES := openssh-server openssh-client iproute2 iptables
# Only the tests need these: the Slurm cluster of testbed/slurm_cluster.py (daemons started by the tests, never
# at boot); buildah and debootstrap build the image (tests/image/), podman runs it on the namespace hosts; jq is
# piped into by an example of docs/cli.md that tests/integration/test_doc_examples.py runs; prometheus scrapes a
# running job's metrics in tests/integration/test_metrics.py (started there on a loopback port);
# chromium-headless-shell draws a `harness report` page into a PNG (tests/integration/test_launch_local.py); strace
# sees every command line a launch starts (tests/integration/test_script_launch.py).
TEST_APT_PACKAGES := slurmctld slurmd slurm-client munge buildah debootstrap podman runc conmon catatonit jq prometheus \
	chromium-headless-shell strace
JOB ?=
HOSTS ?=

# The container image (docker/): REF = $(REGISTRY)/$(IMAGE):$(TAG); IMAGE_FLAGS go to the build.
REGISTRY ?= ghcr.io/example
IMAGE ?= harness
TAG ?= $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' harness/__init__.py)
IMAGE_FLAGS ?=

.PHONY: setup system-packages test-packages test-image lint test test-busy test-fast test-soak test-gpu launch render k8s image push image-test bench bench-quick bench-launch bench-gpu bench-health bench-attach bench-slow lock clean

setup: system-packages $(STAMP)

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do [ "$$(dpkg-query -W -f='$${db:Status-Status}' $$p 2>/dev/null)" = installed ] || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:" $$missing; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# The packages enable their services for boot (S links in /etc/rc[2-5].d, systemd wants links, e.g.
# podman.socket); the tests start their own daemons, so the services this installs are disabled again
# (and stopped, where systemd runs).
test-packages:
	@missing=$$(for p in $(TEST_APT_PACKAGES); do [ "$$(dpkg-query -W -f='$${db:Status-Status}' $$p 2>/dev/null)" = installed ] || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing test packages:" $$missing; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing && \
	  for p in $$missing; do \
	    [ ! -e /etc/init.d/$$p ] || $(SUDO) update-rc.d $$p disable || exit 1; \
	    units=$$(dpkg -L $$p | sed -n 's|^/lib/systemd/system/\([^/@]*\.\(service\|socket\|timer\)\)$$|\1|p'); \
	    [ -z "$$units" ] || $(SUDO) systemctl --root=/ --quiet disable $$units || exit 1; \
	    [ -z "$$units" ] || [ ! -d /run/systemd/system ] || $(SUDO) systemctl stop $$units || exit 1; \
	  done; \
	fi

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock pip setuptools
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[test]' --no-build-isolation
	touch $(STAMP)

# Lint and types first (seconds), then the suite: real hosts, daemons and jobs (minutes).
lint: setup
	$(BIN)/ruff check harness tests bench docker testbed
	$(BIN)/mypy

# The suite's container tests run the image docker/Dockerfile builds: built here, before pytest, into the
# cache that `make image-test` reuses (~7 min cold, seconds warm; tests/image/build.sh).
test-image: setup test-packages
	tests/image/build.sh

# pytest-xdist: a worker more than there are cores, at most 4 (most integration tests wait on their jobs, so
# one more keeps the cores busy: 13.5 min against 14.5 with a worker per core on 2 cores, for the suite of November 2026); the tests that share
# a costly cluster or reference run stay on one worker (tests/conftest.py).
WORKERS := $(shell n=$$(nproc); echo $$(( n + 1 < 4 ? n + 1 : 4 )))
PARALLEL := --numprocesses=$(WORKERS) --dist=loadgroup

test: lint test-packages test-image
	$(BIN)/python -m pytest $(PARALLEL)

# `make test` on a busy machine: two CPU hogs beside it the whole time (CI shares its 2 cores; the suite must hold
# whatever the load). The hogs end with it, however it ends.
test-busy:
	@sh -c 'while :; do :; done' & first=$$!; sh -c 'while :; do :; done' & second=$$!; \
	trap 'kill $$first $$second 2>/dev/null' EXIT INT TERM; $(MAKE) test

# What only length shows (tests marked soak: a healthy 4-node job for five minutes); not in `make test`.
test-soak: setup
	$(BIN)/python -m pytest -m soak

# The unit tier alone (tests/unit, under a minute): no root, daemons, clusters or launches, no lint.
# `make test` runs it too, with tests/integration (the clusters of testbed/, real launches and training).
test-fast: setup
	$(BIN)/python -m pytest $(PARALLEL) tests/unit

# On a CUDA machine: the payload's nccl, bf16, channels_last and compile, `harness launch` on one GPU
# (tests/gpu; `make test` leaves them out, and each fails where torch sees no GPU).
test-gpu: setup
	$(BIN)/python -m pytest tests/gpu

launch: setup
	$(BIN)/harness launch $(or $(JOB),jobs/smoke.yaml) $(if $(HOSTS),--hosts $(HOSTS))

render: setup
	$(BIN)/harness render $(or $(JOB),jobs/smoke.yaml) $(if $(HOSTS),--hosts $(HOSTS))

# Kubernetes manifests for JOB (default jobs/cifar.yaml): jobs/cifar.yaml's into k8s/ (committed; a test fails when they
# drift), another job's into k8s/<its file's name>/, so that `kubectl apply --server-side -f k8s/` never starts it too.
K8S_JOB = $(or $(JOB),jobs/cifar.yaml)
K8S_OUT = k8s$(if $(filter $(abspath jobs/cifar.yaml),$(abspath $(K8S_JOB))),,/$(basename $(notdir $(K8S_JOB))))
k8s: setup
	$(BIN)/harness render $(K8S_JOB) --target k8s --out $(K8S_OUT)

image:
	docker/image.sh build $(REGISTRY)/$(IMAGE):$(TAG) $(IMAGE_FLAGS)

push: image
	docker/image.sh push $(REGISTRY)/$(IMAGE):$(TAG)

# Build docker/Dockerfile for real (buildah, on a debootstrap base) and run jobs/smoke.yaml inside the
# image, with buildah and with podman (root; ~7 min cold, ~1 min warm; cache in
# /var/tmp/harness-image-cache, `rm -rf` it to reset; `make test` builds the same image).
image-test: setup test-packages
	tests/image/run.sh

# Benchmarks (bench/): payload vs the seed recipe, DDP, launch overhead and the harness's cost, preflight
# fan-out, failure propagation, recovery, Slurm, containers, a slow node taken out; JSON under bench/results/, tables in
# docs/benchmarks.md (docs/benchmarking.md says what each measures). Root for the namespace hosts; the full
# run's Slurm cluster and podman hosts need the test packages, the quick run (~70 s on 2 cores) does not.
bench: setup test-packages
	$(BIN)/python -m bench --full

bench-quick: setup
	$(BIN)/python -m bench --quick

# Benchmark 3 alone (~12 min on 2 cores): harness launch against torchrun by hand to the first step and a trivial
# job, in rounds until the 95% interval of the difference is within +-0.1 s or 30 rounds.
bench-launch: setup
	$(BIN)/python -m bench --launch

# The GPU's share alone: throughput vs the seed recipe, batch and compile-mode tuning, DDP over NCCL, the
# harness's cost on the payload's img/s.
bench-gpu: setup
	$(BIN)/python -m bench --gpu

# A lost controller's alone (benchmark 6b, root, ~35 min on 2 cores): `harness attach` against a relaunch on simulated
# nodes and SSH hosts, and a 10 s cut of an SSH host's traffic.
bench-attach: setup test-packages
	$(BIN)/python -m bench --attach

# The health watch's alone (benchmarks 9 and 10, no root, ~21 min on 2 cores): 20 hung launches per fault kind
# (a rank SIGSTOPped, asleep in its step, skipping an all_reduce) against torchrun alone, and the watch's cost.
bench-health: setup
	$(BIN)/python -m bench --health

# A slow node's alone (benchmark 15, root, ~20 min on 2 cores): a node throttled to a quarter of a CPU, taken out by
# restarts.on: slow against left slow to its end, on simulated nodes and on SSH hosts with a spare.
bench-slow: setup
	$(BIN)/python -m bench --slow

# Re-pin the full dependency closure (pip and setuptools included) after changing a pin in pyproject.toml.
lock: $(STAMP)
	$(BIN)/pip freeze --all --exclude-editable --disable-pip-version-check | sort > requirements.lock

clean:
	rm -rf $(VENV) runs .pytest_cache
