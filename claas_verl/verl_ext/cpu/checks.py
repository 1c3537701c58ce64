"""Clear errors for the mistakes a CPU/GPU user makes first: each names the key or library and the fix."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable


def check_model_path(path: str, key: str = "actor_rollout_ref.model.path") -> None:
    """Raise ``FileNotFoundError`` unless ``path`` is a local Hugging Face model directory."""
    if not path or not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{key}={path!r} is not a local Hugging Face model directory (no config.json). "
            "Build the offline tiny model with `python -m claas_verl.tiny make /tmp/claas_verl_tiny` "
            f"(or set CLAAS_TINY_DIR), or point {key} at a downloaded model."
        )


SUPPORTED_DEVICES = ("cpu", "cuda", "npu")


def check_trainer_device(device: str, cuda_available: bool) -> None:
    """Raise ``ValueError`` naming ``trainer.device`` when it is unknown or names a missing accelerator."""
    if device not in SUPPORTED_DEVICES:
        raise ValueError(f"trainer.device={device!r} is not supported; use one of {SUPPORTED_DEVICES}.")
    if device == "cuda" and not cuda_available:
        raise ValueError(
            "trainer.device=cuda but torch sees no CUDA device on this machine. To train on CPU add "
            "`+cpu=default` to the command (verl's main_ppo; it also selects the 'hf' rollout and gloo), "
            "or run on a GPU machine with `pip install -e .[gpu]`."
        )


def guard_auto_set_device(main_ppo_module) -> None:
    """P5: after verl's ``auto_set_device`` in ``main_ppo.main``, check ``trainer.device`` (before Ray starts).

    Without this, a CPU-only user who forgot the CPU preset gets a CUDA error deep inside a Ray worker
    minutes later. ``main_ppo`` imports ``auto_set_device`` into its namespace, so that name is wrapped.
    """
    import functools

    original = main_ppo_module.auto_set_device
    if getattr(original, "_claas_device_check", False):
        return

    @functools.wraps(original)
    def auto_set_device(config) -> None:
        original(config)
        device = getattr(getattr(config, "trainer", None), "device", None)
        if device is not None:
            import torch

            check_trainer_device(str(device), torch.cuda.is_available())

    auto_set_device._claas_device_check = True
    main_ppo_module.auto_set_device = auto_set_device


def require_library(module: str, purpose: str, fix: str) -> None:
    """Raise ``ImportError`` naming ``module`` when it is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{purpose} needs the '{module}' library, which is not installed. Fix: {fix}")


VLLM_FIX = (
    "on a GPU machine `pip install -e .[gpu]`; on a CPU-only machine add `+cpu=default` "
    "(sets actor_rollout_ref.rollout.name=hf)"
)


def guard_rollout_loader(name: str, loader: Callable[[], type], library: str) -> Callable[[], type]:
    """Wrap a ``RolloutReplicaRegistry`` loader so a missing backend library gets a clear message.

    verl's vLLM module raises ``ValueError`` (not ``ImportError``) on import without vllm, and
    the resulting traceback never says "install vllm".
    """

    def load():
        require_library(library, f"actor_rollout_ref.rollout.name={name}", VLLM_FIX)
        return loader()

    load.__wrapped__ = loader
    return load
