# The README's first two commands: `make demo` and `make test`. Both build .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A torch wheel already on this machine (a CPU build) is installed first, so pip does not
# download a multi-GB CUDA build to satisfy the range in pyproject.toml.
TORCH_WHEEL_DIR ?= /opt/wheels

.PHONY: demo test test-vllm bench-vllm vllm-venv venv bench lint proto clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	whl=$$(ls $(TORCH_WHEEL_DIR)/torch-*.whl 2>/dev/null | sort -V | tail -n 1); \
	if [ -n "$$whl" ] && ! $(PY) -c 'import torch' 2>/dev/null; then $(PIP) install -q "$$whl"; fi
	$(PIP) install -q -e '.[test,hf]'
	touch $@

demo: venv
	$(VENV)/bin/tierd demo

test: venv
	$(PY) -m pytest -q

# Real vLLM for tests/vllm/: its own venv (~9.4 GiB, ~3 min to build), kept outside the clone and
# keyed by the vLLM version so repeated runs and fresh clones reuse it. tierd's own dependencies
# are installed into it; tierd itself is imported from this clone (PYTHONPATH), so two clones
# never fight over one installed copy.
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

test-vllm: vllm-venv
	PYTHONPATH=$(CURDIR) VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -p no:cacheprovider -m vllm tests/vllm

# `tierd bench vllm` with vLLM's own KV views (ARGS="--model llama3-70b", ...).
bench-vllm: vllm-venv
	PYTHONPATH=$(CURDIR) VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m tierd.cli bench vllm $(ARGS)

bench: venv
	$(VENV)/bin/tierd bench all

lint: venv
	bash .ci/mypy $(abspath $(PY))

# Regenerates the committed gRPC stubs (tierd/v1/*_pb2*.py) from proto/.
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/tierd/v1/tierd.proto

clean:
	rm -rf $(VENV) build *.egg-info
