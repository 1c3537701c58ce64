# claas_verl — two commands for a fresh machine (see README):
#   make demo   create .venv, install pinned dependencies, build the offline tiny models and run the
#               continual MOPD demo on CPU (Seq vs Replay-KL on three tiny domains, forgetting tables)
#   make test   create .venv, install pinned dependencies, lint, run the CPU test suite
# Other demos: make demo-grpo (verl's own GRPO on CPU), make demo-claas (CLaaS replay trainer on CPU)
#   make test-cluster  the README's cluster commands (ray start + ray job submit of the tiny recipes, a
#               two-node cluster) and the "own verl pipeline" path (main_ppo + claas_verl via its plugin);
#               slow (tens of minutes on 2 cores); starts and stops only its own Ray nodes
#
# On a CPU-only machine torch is installed first as the pinned CPU wheel, so that nothing
# later can pull a multi-GB CUDA build. GPU clusters: `make install TORCH_SPEC=` and
# `pip install -e .[gpu]` (vllm brings its own CUDA torch).

PYTHON_BIN ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.claas_verl_installed

.PHONY: install test test-cluster lint demo demo-grpo demo-claas clean

# Demo scripts start subprocesses (`python -m ...`): put the venv first on PATH.
RUN := PATH="$(abspath $(VENV))/bin:$$PATH"

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC))
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check claas_verl tests benchmarks examples

test: lint
	$(PY) -m pytest -q

test-cluster: install
	$(RUN) $(PY) -m pytest -q -m slow tests/cluster

demo: install
	$(RUN) $(PY) examples/run_mopd_demo.py

demo-grpo: install
	$(RUN) examples/tiny_grpo_cpu.sh

demo-claas: install
	$(RUN) $(PY) examples/run_claas_demo.py

clean:
	rm -rf $(VENV) build *.egg-info
