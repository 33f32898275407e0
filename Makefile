# The README's two commands: `make demo` and `make test`. Both start with `make install`, so a
# fresh machine needs nothing else (Go >= 1.26 and Python >= 3.11 are on the machine image).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install gym-install controlplane images test lint typecheck unit demo demo-kwok demo-down bench crd clean gpu gpu-tests gpu-bench

install: $(STAMP)

# The `gpu` extra (torch) too: the torch backend's paging/batching logic and the collective refit's
# fault paths (torch.distributed over gloo) run on the CPU in CI. PyPI's Linux torch wheel is the
# CUDA build and imports only with its nvidia-* wheels: ~3 GB downloaded, 4.7 GB installed, ~50 s
# here; there is no CPU-only wheel on PyPI. constraints/dev.txt pins it to the GPU machine's torch.
$(STAMP): pyproject.toml constraints/dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,ray,gpu]' -c constraints/dev.txt
	@touch $(STAMP)

# NeMo-Gym 0.7.0 (the real client of tests/gym) in its own venv: it declares Python >= 3.13.14 and
# pins openai 2.44.0, so it stays out of .venv. Wheels only, but antlr4-python3-runtime 4.9.3 (hydra's
# parser; pure Python) exists only as an sdist. Versions: tests/realgym/requirements.txt + constraints.txt.
GYM_VENV := .venv-gym
GYM_STAMP := $(GYM_VENV)/.installed

gym-install: $(GYM_STAMP)

$(GYM_STAMP): tests/realgym/requirements.txt tests/realgym/constraints.txt
	@test -x $(GYM_VENV)/bin/python || $(PYTHON) -m venv $(GYM_VENV)
	$(GYM_VENV)/bin/pip install --quiet --upgrade pip
	$(GYM_VENV)/bin/pip install --quiet --ignore-requires-python --only-binary=:all: \
		--no-binary=antlr4-python3-runtime -r tests/realgym/requirements.txt -c tests/realgym/constraints.txt
	@touch $(GYM_STAMP)

# Builds etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kwok and helm
# from Go modules into ~/.cache/drs (keyed by versions; a second run builds nothing).
controlplane: install
	$(BIN)/drs dev build

# Builds the top-level Dockerfile into drs:<version> (and the sandbox image drs-pause) with no
# registry: a private dockerd, a Debian base made with mmdebstrap, the host's CA bundle as a build
# secret. Cached by the sources' digest in ~/.cache/drs/images. Also its gym target, drs-gym:<version>
# (NeMo-Gym 0.7.0 at tests/realgym's pins, make demo's Gym pod), cached by its own inputs' digest
# (`drs dev images --no-gym` skips it).
images: install
	$(BIN)/drs dev images

lint: install
	$(BIN)/ruff check cli operator frontend engine_image protocol devcluster sidecar client tests bench examples
	$(BIN)/ruff format --check cli operator frontend engine_image protocol devcluster sidecar client tests bench examples

typecheck: install
	$(BIN)/mypy cli/drs_cli operator/drs_operator frontend/drs_frontend engine_image/drs_engine protocol/drs_protocol devcluster/drs_devcluster sidecar/drs_sidecar client/drs_client bench examples
	$(BIN)/mypy tests

test: install gym-install controlplane lint typecheck
	$(BIN)/pytest $(PYTEST_ARGS)

unit: install gym-install
	$(BIN)/pytest -m "not cluster" $(PYTEST_ARGS)

# The operator installed by Helm from the image built here, the fleet as containers on a real node
# (needs root: a kubelet, containerd and a CNI bridge of the dev cluster's own), driven from pods by
# our client, by the real NeMo-Gym 0.7.0 (drs-gym) and by a trainer's refit.
demo: install controlplane
	$(BIN)/python examples/demo.py

# The same fleet on simulated nodes, its pods run as local processes by the pod runner.
demo-kwok: install controlplane
	$(BIN)/python examples/demo_kwok.py

demo-down: install
	$(BIN)/drs dev down

# Benchmarks (not tests): each prints one JSON line; results and the machine go in docs/results.md.
bench: install controlplane
	$(BIN)/python bench/relay.py
	$(BIN)/python bench/tokenization.py
	$(BIN)/python bench/operator_scale.py

# On a machine with CUDA GPUs: the whole GPU suite (tests/gpu) and bench/gpu_disagg.py in one go,
# with GPU_PYTHON (a python3 with torch and this package importable: pip install -e '.[gpu,test]',
# or PYTHONPATH over the source roots). Results go to GPU_OUT ($$OUT when set, else gpu-results/).
# NVLink multicast stays off in every process (a shared host's GPUs).
GPU_PYTHON ?= python3
GPU_OUT ?= $(if $(OUT),$(OUT),gpu-results)
GPU_ENV := NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

gpu: gpu-tests gpu-bench

# --confcutdir: the GPU suite needs none of the cluster fixtures (nor their packages).
gpu-tests:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_ENV) $(GPU_PYTHON) -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -rs -v \
		--junitxml=$(GPU_OUT)/gpu-tests.xml 2>&1 | tee $(GPU_OUT)/gpu-tests.log

gpu-bench:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_ENV) $(GPU_PYTHON) bench/gpu_disagg.py 2>$(GPU_OUT)/gpu_disagg.log | tee $(GPU_OUT)/gpu_disagg.json
	set -o pipefail; $(GPU_ENV) $(GPU_PYTHON) bench/weights_digest.py 2>$(GPU_OUT)/weights_digest.log | tee $(GPU_OUT)/weights_digest.json

crd: install
	$(BIN)/drs crd > crds/disagg.dev_disaggreplicasets.yaml
	cp crds/disagg.dev_disaggreplicasets.yaml helm/drs-operator/crds/disagg.dev_disaggreplicasets.yaml
	$(BIN)/drs crd --api-reference > docs/api-reference.md

clean:
	rm -rf $(VENV) $(GYM_VENV) .pytest_cache .mypy_cache .ruff_cache
