"""Where verl's engine computes in this worker process, and the autocast its forward runs under.

Shared by every forward the project runs through verl's FSDP engine outside verl's own passes (MOPD's balanced
step and teacher pass, the fixed probes, the weight-sync probe of both trainers).
"""

from __future__ import annotations

import contextlib

import torch


def compute_device() -> torch.device:
    """The device verl's engines compute on in this process (where ``FSDPEngine.forward_step`` puts each
    micro-batch), from verl's platform helpers. Never the device of a module's parameters: forward-only FSDP2
    engines (teachers, like verl's reference model) keep their weights offloaded to the host and gather each
    layer onto the accelerator for its forward."""
    from verl.utils.device import get_device_id, get_device_name

    index = get_device_id()
    return torch.device(index) if isinstance(index, str) else torch.device(get_device_name(), index)


def engine_autocast(engine, device):
    """The autocast verl's engine wraps its forward in (bf16 under bf16 mixed precision; none for fp32), for the
    engine's compute ``device`` (:func:`compute_device`)."""
    dtype = getattr(engine, "_autocast_dtype", None)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
