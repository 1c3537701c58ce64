"""benchmarks/host.py: the machine a run was made on, as its record names it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.host import cpu_model, host_signature  # noqa: E402


def test_the_cpu_model_is_read_from_cpuinfo_and_falls_back_without_it(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert cpu_model(info) == "AMD EPYC 9B14"
    assert cpu_model(tmp_path / "missing") != ""


def test_the_signature_names_the_kernels_torch_dispatches_to():
    sig = host_signature()
    assert sig["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert sig["torch"] == torch.__version__ and sig["cpu"]
