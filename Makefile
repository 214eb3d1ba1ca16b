# Two commands for a newcomer: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The image `make image` builds; the chart's default (helm/extproc values: extproc.image) is
# the same name at the chart's appVersion.
IMAGE   ?= envoy-llm-admission
VERSION := $(shell sed -n 's/^appVersion: "\(.*\)"/\1/p' helm/extproc/Chart.yaml)

.PHONY: setup system-packages demo test check lint typecheck chaos bench bench-memory eval clean \
	image-name image image-test test-fast config-schema loadtool

setup: $(STAMP) system-packages

# The tests start their own redis-server processes (standalone, Sentinel, Cluster, TLS with
# certificates made by openssl); never the system service apt may start on port 6379.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "missing:$$missing -- install as root: apt-get install -y$$missing"; exit 1; \
	fi; \
	echo "installing$$missing"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/extproc demo

# What CI runs (.ci/run): the linter, the type checker (mypy --strict), then the suite in two
# pytest processes side by side: the simulations (marked `slow`, no processes or ports: CPU)
# beside everything else (mostly waiting on Envoy, Redis and child processes), which on 2
# cores is ~3 minutes shorter than one after the other. The simulations' output follows.
# (A -m given here replaces pyproject.toml's addopts -m, so SKIPPED is read from there.)
SIMS    := slow and not integration and not redis
SKIPPED := $(shell sed -n "s/^addopts = \"-m '\(.*\)'\"$$/\1/p" pyproject.toml)
test: lint typecheck
	@mkdir -p out
	@$(PY) -m pytest -q -p no:cacheprovider -m '$(SIMS) and $(SKIPPED)' >out/test-sims.log 2>&1 & \
	sims=$$!; trap 'kill $$sims 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -m 'not ($(SIMS)) and $(SKIPPED)'; rest=$$?; \
	wait $$sims; s=$$?; echo "--- the simulations (out/test-sims.log):"; cat out/test-sims.log; \
	[ $$rest = 0 ] && [ $$s = 0 ]

# Unit tests only: no Envoy, Redis, helm or child processes (seconds, not minutes).
test-fast: setup
	$(PY) -m pytest -q -m 'not integration and not redis and not slow and not soak and not chaos and not image'

# The chart's values.schema.json `config` section and the README's table of every key, written
# from extproc/config/'s models (tests/test_config_schema.py fails when they differ).
config-schema: setup
	$(PY) -m extproc.config.schema

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy extproc

check: test

# The failure-mode guarantees measured at length (~3 min on 2 cores: 100 bursts, kill -9 of a
# replica under 30 s of load both ways, 10 Redis restarts), figures to out/chaos/*.json; the
# short runs of the same scenarios are part of `make test` (tests/test_chaos.py says which).
chaos: setup
	EXTPROC_CHAOS_OUT=out/chaos $(PY) -m pytest -q -s -m chaos tests/test_chaos.py

# Per-request overhead next to its floors, in one run, with issue 19's targets and py-spy
# profiles of extproc serve under load (~9 min; benchmarks/bench.py says how, and
# docs/performance.md reads the latest run).
# wrk drives the saturation runs: installed here when missing, as system-packages does.
# Arguments through BENCH_ARGS, e.g. `make bench BENCH_ARGS="--quick --workers 0"`.
bench: setup
	@command -v wrk >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "missing: wrk -- install as root: apt-get install -y wrk"; exit 1; \
		fi; \
		echo "installing wrk"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q >/dev/null && apt-get install -y -q wrk >/dev/null; }
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	$(PY) benchmarks/counting.py

# Resident memory across a million decisions (~15-30 min on 2 cores; benchmarks/memory.py).
# A standard load tool's report on the local stack, with admission and without
# (benchmarks/loadtool.py; ~3 min, and ~2 min more the first time to install NVIDIA's AIPerf
# into its own virtual environment, .venv-load: README "Reading a load tool's report").
LOAD_VENV := .venv-load
AIPERF    := aiperf==0.13.0
loadtool: setup
	@test -x $(LOAD_VENV)/bin/aiperf || { echo "installing $(AIPERF) into $(LOAD_VENV)"; \
		$(PYTHON) -m venv $(LOAD_VENV) && $(LOAD_VENV)/bin/pip install -q $(AIPERF); }
	$(PY) benchmarks/loadtool.py --aiperf $(LOAD_VENV)/bin/aiperf

bench-memory: setup
	$(PY) benchmarks/memory.py

# The evaluation matrix (the two 70B fleets' 90 cells: 14 CPU-minutes without the tuned
# sweep; 8b-vllm's are the costliest, its incident cell at 3x alone 12 CPU-minutes;
# extproc/sim/evaluate.py says what it runs), then the autoscaling section (~1 min), into
# out/eval/. Arguments through EVAL_ARGS, e.g.
# `make eval EVAL_ARGS=--reduced`.
eval: setup
	$(VENV)/bin/extproc eval --out out/eval $(EVAL_ARGS)
	$(VENV)/bin/extproc eval --autoscale --seeds 3 --out out/eval

image-name:
	@echo $(IMAGE):$(VERSION)

# The sidecar's image from Containerfile, without Docker (buildah, chroot isolation; a Debian
# base from mmdebstrap where no registry is reachable: scripts/image.sh). About 1 min on 2 cores
# with the base already made, 2 the first time; IMAGE_BASE=<python 3.11 image> skips mmdebstrap.
image: setup
	@command -v buildah >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "missing: buildah mmdebstrap -- install as root: apt-get install -y buildah mmdebstrap podman runc"; exit 1; \
		fi; \
		echo "installing buildah mmdebstrap podman runc"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q >/dev/null && apt-get install -y -q buildah mmdebstrap podman runc >/dev/null; }
	PY=$(PY) scripts/image.sh $(IMAGE):$(VERSION)

# The chart's pod shape run from the image with podman (init container rendering Envoy's
# config, Envoy, the sidecar, a fake backend): a 200 and a 429 through it. Not in `make test`.
image-test: image
	$(PY) -m pytest -q -m image tests/test_image.py

clean:
	rm -rf $(VENV) $(LOAD_VENV) .demo .pytest_cache .mypy_cache .ruff_cache .image-wheels build
