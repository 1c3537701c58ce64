"""A CPU platform for verl's ``PlatformRegistry`` (``verl/plugin/platform``).

verl asks its platform for the torch device module, the collective backend, the
Ray resource name and a few memory/profiling hooks. On CPU: the device is
``cpu``, collectives use gloo, memory hooks are no-ops, and the Ray resource
stays ``"GPU"`` because verl's ``ResourcePoolManager`` only counts GPUs — the
CPU preset (``recipes/cpu/default.yaml``) therefore declares *logical* GPUs to
Ray (one per training rank); nothing ever runs CUDA code on them.

Selection: ``VERL_PLATFORM=cpu`` (set by the CPU preset in every Ray worker's
runtime env) or auto-detection, where this platform is probed after verl's
built-ins (it registers later) and so is chosen only when no accelerator exists.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _noop(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _mem_get_info(*args, **kwargs) -> tuple[int, int]:
    # (free, total) in bytes; verl only logs it. Report the host's RAM so ratios stay sane.
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _build_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style functions verl calls on its device module.

    ``torch.cpu`` lacks memory statistics, ``empty_cache``, ``ipc_collect`` and RNG state
    helpers; verl calls them on whatever ``get_torch_device()`` returns, so provide CPU
    meanings: no-ops / zeros for the allocator, the global CPU generator for RNG state.
    """
    mod = types.ModuleType("claas_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.empty_cache = _noop
    mod.ipc_collect = _noop
    mod.set_per_process_memory_fraction = _noop
    mod.reset_peak_memory_stats = _noop
    mod.memory_allocated = _zero
    mod.memory_reserved = _zero
    mod.max_memory_allocated = _zero
    mod.max_memory_reserved = _zero
    mod.mem_get_info = _mem_get_info
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.manual_seed = lambda seed: torch.manual_seed(seed)
    mod.manual_seed_all = lambda seed: torch.manual_seed(seed)
    mod.is_available = lambda: True
    mod.set_device = _noop
    mod.current_device = lambda: "cpu"
    return mod


CPU_DEVICE_MODULE = _build_device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts: torch device ``cpu``, gloo collectives, logical Ray GPUs."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Probed after verl's built-in platforms, so this only wins when no accelerator answered.
        return True

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this to tensor.to(...) / torch.device(...); the int 0 would mean cuda:0.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the logical GPUs; harmless on a CPU-only host.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's ResourcePoolManager counts "GPU" only; the CPU preset declares logical GPUs.
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
