# Every target builds the project's own virtual environment first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip==24.2"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/shardzero partition gpt:small --mesh batch=2,model=4 \
	  --tactics "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1)" --verify

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) benchmarks/bench_partitioner.py
	$(PY) benchmarks/bench_cost_model.py
	$(PY) benchmarks/bench_environment.py

clean:
	rm -rf $(VENV) build *.egg-info
