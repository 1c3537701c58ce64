"""claas_verl: continual learning for LLMs on veRL and Ray.

Install order on a CPU-only machine (see docs/getting-started.md): ``pip install torch==2.13.0``
first, then ``pip install -e .[test]``. torch is deliberately *not* listed as a
requirement: an unpinned torch requirement makes pip pull a multi-GB CUDA build
on machines that have none. verl is pinned with its ``verl-core`` extra (plain
``verl`` lacks modules its trainer imports; its ``cpu``/``fsdp``/``vllm`` extras
pin another torch).
"""

from setuptools import find_packages, setup

VERL_VERSION = "0.9.1"
# The cluster commands of docs/cluster.md (token auth, ray start, ray job submit) are tested with this Ray
# (tests/cluster/); 2.61 changes the token-auth defaults again, so newer releases are not accepted untested.
RAY_VERSION = "2.60.0"
# GPU machines: the set verl 0.9.1 was released against (third_party/gpu_constraints.txt; `make install-gpu`).
# flash-attn is left out of the extra: PyPI has it as an sdist whose build imports torch, which pip's build
# isolation hides, so `make install-gpu` builds it with --no-build-isolation once torch is in place.
GPU_CONSTRAINTS = "third_party/gpu_constraints.txt"


def gpu_pins() -> list[str]:
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), GPU_CONSTRAINTS)
    pins = [line.split("#", 1)[0].strip() for line in open(path, encoding="utf-8")]
    return [p for p in pins if p and not p.startswith("flash-attn")]


setup(
    name="claas_verl",
    version="0.1.0",
    description="CLaaS replay-buffer RL and continual multi-teacher on-policy distillation (MOPD) on veRL",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["claas_verl", "claas_verl.*"]),
    include_package_data=True,
    install_requires=[
        f"verl[verl-core]=={VERL_VERSION}",
        f"ray[default]=={RAY_VERSION}",
        "hydra-core==1.3.*",
        "omegaconf>=2.3",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "peft>=0.14",
        "numpy",
        "pyarrow",
        "pandas",
        "filelock",
        "matplotlib",
        # seccomp filter of the grader sandbox (ctypes bindings to the system's libseccomp.so.2)
        "pyseccomp>=0.1.2",
        # /metrics of the chat service (claas_verl.claas.service.metrics)
        "prometheus-client>=0.17",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "ruff==0.14.*", "openai>=1.40"],
        "wandb": ["wandb"],
        # the documentation site (`make docs`: mkdocs.yml, docs/), built strict by `make test`
        "docs": ["mkdocs==1.6.1"],
        # Benchmark evaluation (claas_verl.mopd.eval) and the MOPD data builder (claas_verl.mopd.data). lm-eval carries
        # the BBH/MuSR/IFEval/MBPP+ prompts and metrics (langdetect, immutabledict: its IFEval verifiers);
        # math-verify pinned to the antlr4 4.9.3 runtime that hydra needs. evalplus itself is installed with
        # --no-deps by `make install-eval` (its hard requirements anthropic and google-generativeai would
        # downgrade protobuf under ray/verl); its light runtime dependencies are listed here.
        "eval": [
            "lm-eval==0.4.13",
            "math-verify[antlr4_9_3]==0.9.0",
            "reasoning-gym==0.1.25",
            "openai>=1.40",
            "langdetect",
            "immutabledict",
            "wget",
            "tempdir",
            "multipledispatch",
            "appdirs",
            "fire",
            "termcolor",
            "tree-sitter>=0.22",
            "tree-sitter-python>=0.21",
            "stop-sequencer",
        ],
        # GPU machines only, through `make install-gpu` (exact pins; flash-attn built there)
        "gpu": gpu_pins(),
    },
    entry_points={
        # verl imports every "verl.plugins" entry point at `import verl`, in the driver and in
        # every Ray worker, so claas_verl's CPU platform, rollout and registered losses exist everywhere.
        "verl.plugins": ["claas_verl = claas_verl.verl_ext.plugin"],
    },
)
