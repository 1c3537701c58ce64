# claas_verl — two commands for a fresh machine (see README):
#   make demo   create .venv, install pinned dependencies, build the offline tiny models and run the
#               continual MOPD demo on CPU (Seq vs Replay-KL on three tiny domains, forgetting tables)
#   make test   create .venv, install pinned dependencies, lint, run the CPU test suite
# Other demos: make demo-grpo (verl's own GRPO on CPU), make demo-claas (CLaaS replay trainer on CPU)
#
# On a CPU-only machine torch is installed first as the pinned CPU wheel, so that nothing
# later can pull a multi-GB CUDA build. GPU clusters: `make install TORCH_SPEC=` and
# `pip install -e .[gpu]` (vllm brings its own CUDA torch).

PYTHON_BIN ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.claas_verl_installed

.PHONY: install install-eval test lint demo demo-grpo demo-claas clean

# Demo scripts start subprocesses (`python -m ...`): put the venv first on PATH.
RUN := PATH="$(abspath $(VENV))/bin:$$PATH"

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC))
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,eval]'
	$(EVALPLUS_INSTALL)
	touch $(STAMP)

install: $(STAMP)

# The evaluation/data extras (lm-eval, math-verify, reasoning-gym, openai) are part of every install, so
# `make test` runs their tests. evalplus goes in with --no-deps: its hard requirements anthropic and
# google-generativeai would downgrade protobuf under ray/verl (its light dependencies are in the `eval` extra).
EVALPLUS_INSTALL = $(PY) -m pip install -q --disable-pip-version-check --no-deps 'evalplus==0.3.1'

install-eval: install
	$(PY) -m pip install -q --disable-pip-version-check -e '.[eval]'
	$(EVALPLUS_INSTALL)

lint: install
	$(VENV)/bin/ruff check claas_verl tests benchmarks examples

test: lint
	$(PY) -m pytest -q

demo: install
	$(RUN) $(PY) examples/run_mopd_demo.py

demo-grpo: install
	$(RUN) examples/tiny_grpo_cpu.sh

demo-claas: install
	$(RUN) $(PY) examples/run_claas_demo.py

clean:
	rm -rf $(VENV) build *.egg-info
