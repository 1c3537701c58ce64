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


def check_device(trainer_device: str, platform_device: str) -> None:
    """Raise ``ValueError`` when ``trainer.device`` disagrees with verl's active platform."""
    supported = ("cpu", "cuda", "npu")
    if trainer_device not in supported:
        raise ValueError(f"trainer.device={trainer_device!r} is not supported; use one of {supported}.")
    if trainer_device == "cpu" and platform_device != "cpu":
        raise ValueError(
            f"trainer.device=cpu but verl's platform is {platform_device!r}: add `+cpu=default` to the "
            "command (it sets VERL_PLATFORM=cpu in every Ray process), or export VERL_PLATFORM=cpu."
        )


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
