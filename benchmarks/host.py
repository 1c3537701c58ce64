"""The machine a benchmark run was made on, recorded with the run (``host`` in its record).

The CPU runs are deterministic on one machine but not across machines: torch picks its CPU kernels (and MKL its
code paths) by the instruction set it finds, and a committed stage-proxy run made again on another x86 machine
differed from its record in the 7th significant digit of its first step and by 0.07 in forgetting after three
stages (``benchmarks/LOG.md``, 2026-12-06). A record that names its machine lets a comparison say which of its
pairs were made on one machine.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_signature() -> dict[str, str]:
    """``{"cpu", "cpu_capability", "torch"}``: the CPU model, the kernel level torch dispatches to on it (``AVX2``,
    ``AVX512``, ...; ``ATEN_CPU_CAPABILITY`` lowers it) and torch's version: what decides the arithmetic."""
    import torch

    return {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}

