# claas_verl — two commands for a fresh machine (see README):
#   make demo   create .venv, install pinned dependencies, build the offline tiny models, run the CPU demo
#   make test   create .venv, install pinned dependencies, lint, run the CPU test suite
#
# On a CPU-only machine torch is installed first as the pinned CPU wheel, so that nothing
# later can pull a multi-GB CUDA build. GPU clusters: `make install TORCH_SPEC=` and
# `pip install -e .[gpu]` (vllm brings its own CUDA torch).

PYTHON_BIN ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.claas_verl_installed

.PHONY: install test lint demo demo-grpo clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check claas_verl tests benchmarks examples

test: lint
	$(PY) -m pytest -q

demo: install
	$(PY) -m claas_verl.tiny make $${CLAAS_TINY_DIR:-/tmp/claas_verl_tiny}
	$(PY) examples/run_demo.py

clean:
	rm -rf $(VENV) build *.egg-info
