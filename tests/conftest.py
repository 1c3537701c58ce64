"""Suite-wide settings and fixtures.

Two shared cores: torch's default intra-op threading makes each tiny forward
pass tens of times slower when several processes compete, so every test
process uses one thread (Ray workers get OMP_NUM_THREADS=1 from the recipes).
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny():
    """Offline tiny student, experts, tokenizer and data (built once, file-locked, reused across runs)."""
    from claas_verl.tiny import ensure_tiny

    return ensure_tiny()  # honours $CLAAS_TINY_DIR, default /tmp/claas_verl_tiny


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for every in-process Ray test (starting one costs tens of seconds on 2 cores).

    Workers get the CPU platform and one thread each. End-to-end tests that launch verl's own
    entry points run them in a subprocess, which starts its own cluster as a user's job would.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "env_vars": {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            },
        )
    yield ray
    if started:
        ray.shutdown()
