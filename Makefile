# Two entry points for a fresh machine: `make demo` (the local demo) and `make test` (the suite).
# Both install what they need first; every step is idempotent and cached.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.tessera-installed
# the uv the dev extra pins: it bootstraps the install
UV_VERSION := $(shell sed -n 's/^ *"uv==\([^"]*\)",$$/\1/p' pyproject.toml)

.PHONY: demo test setup deps system controlplane lint

demo: setup
	$(BIN)/tessera-dev demo

test: setup lint
	$(BIN)/pytest -p no:cacheprovider --durations=25

setup: deps system controlplane

deps: $(STAMP)
# uv installs the same versions pip would, minutes faster (torch's CUDA wheels are GBs); pip stays
# for the packaging tests, which build the wheel with it as an image's build does. The images'
# lock holds what they share with the tests at the versions the images get: a release on the
# index after the lock changes neither.
CONSTRAINTS := $(wildcard constraints/*.txt)
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --python $(BIN)/python $(addprefix -c ,$(CONSTRAINTS)) -e '.[test]'
	touch $(STAMP)

# Debian packages: Prometheus for the metrics tests and the demo, openssl for the control plane's
# certificates. kubectl comes with the machine; say so plainly if it does not.
system:
	command -v prometheus >/dev/null && command -v openssl >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus openssl; }
	@command -v kubectl >/dev/null || { echo "kubectl is not on the PATH: install it first" >&2; exit 1; }
	@command -v go >/dev/null || { echo "Go >= 1.26 is needed to build the control plane: kube-apiserver, kube-scheduler, kube-controller-manager and etcd (or set TESSERA_BIN_DIR)" >&2; exit 1; }

# TESSERA_BIN_DIR: the control plane's binaries built elsewhere, used as they are.
controlplane: deps
	test -n "$$TESSERA_BIN_DIR" || $(BIN)/tessera-dev build-controlplane

lint: deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
