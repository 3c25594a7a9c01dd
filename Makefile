# The README's first two commands: `make demo` and `make test`. Both build .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A torch wheel already on this machine (a CPU build) is installed first, so pip does not
# download a multi-GB CUDA build to satisfy the range in pyproject.toml.
TORCH_WHEEL_DIR ?= /opt/wheels

.PHONY: demo test venv bench lint proto clean

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

bench: venv
	$(VENV)/bin/tierd bench all

lint: venv
	bash .ci/mypy $(abspath $(PY))

# Regenerates the committed gRPC stubs (tierd/v1/*_pb2*.py) from proto/.
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/tierd/v1/tierd.proto

clean:
	rm -rf $(VENV) build *.egg-info
