# The verbs users type. `make setup` once on a fresh machine, then `make test` / `make launch`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# System packages the tests need: sshd, network namespaces and firewalls for the multi-host cluster.
APT_PACKAGES := openssh-server openssh-client iproute2 iptables
JOB ?=
HOSTS ?=

.PHONY: setup system-packages test launch render k8s lock clean

setup: system-packages $(STAMP)

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:" $$missing; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[test]' --no-build-isolation
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest

launch: setup
	$(BIN)/harness launch $(or $(JOB),jobs/smoke.yaml) $(if $(HOSTS),--hosts $(HOSTS))

render: setup
	$(BIN)/harness render $(or $(JOB),jobs/smoke.yaml) $(if $(HOSTS),--hosts $(HOSTS))

# Kubernetes manifests for JOB (default jobs/cifar.yaml) into k8s/ (committed for jobs/cifar.yaml; a test fails when they drift).
k8s: setup
	$(BIN)/harness render $(or $(JOB),jobs/cifar.yaml) --target k8s --out k8s

# Re-pin the full dependency closure after changing a pin in pyproject.toml.
lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable --disable-pip-version-check | sort > requirements.lock

clean:
	rm -rf $(VENV) runs .pytest_cache
