"""The GPU install's pins (third_party/gpu_constraints.txt) are the set verl 0.9.1 was released against, and the one
install path (``make install-gpu``) uses them at every step.

The pins are read against verl's own metadata in this environment (its ``vllm`` extra pins torch, torchvision,
torchaudio, vLLM and transformers; its flash-attn extra pins flash-attn). The resolution itself needs the package
index: ``make check-gpu-install`` runs it and commits its summary (third_party/gpu_install_check.txt), checked here for
being about these pins; the slow test runs it again.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _load_check():
    spec = importlib.util.spec_from_file_location("gpu_install_check", REPO / "third_party" / "gpu_install_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load_check()
PINS = check.read_pins()


def verl_extra_pins(extra: str) -> dict[str, str]:
    pins = {}
    for raw in importlib.metadata.requires("verl"):
        req = Requirement(raw)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and str(req.specifier).startswith("=="):
            pins[check.normalize(req.name)] = str(req.specifier)[2:]
    return pins


def setup_gpu_extra() -> list[str]:
    """setup.py's ``gpu`` extra, from its own ``gpu_pins()`` (run without running setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "gpu_pins"
            or isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "GPU_CONSTRAINTS" for t in n.targets)]
    scope = {"__file__": str(REPO / "setup.py")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), scope)
    return scope["gpu_pins"]()


def test_pins_are_the_set_verl_was_released_against():
    assert importlib.metadata.version("verl") == "0.9.1"
    released = verl_extra_pins("vllm")
    assert set(released) == {"torch", "torchvision", "torchaudio", "vllm", "transformers"}
    assert {k: PINS[k] for k in released} == released
    flash = {k: v for extra in ("flash-attn-cu130torch211",) for k, v in verl_extra_pins(extra).items()}
    assert PINS["flash-attn"] == flash["flash-attn"]
    assert Version(PINS["vllm"]) >= Version(".".join(map(str, check.VLLM_MIN)))  # verl's rollout refuses older


def test_pinned_transformers_is_inside_verls_own_range():
    base = [Requirement(r) for r in importlib.metadata.requires("verl") if r.startswith("transformers") and
            "extra" not in r]
    assert base and all(Version(PINS["transformers"]) in r.specifier for r in base)


def test_setup_gpu_extra_lists_the_pins_but_the_source_built_one():
    extra = {check.req_name(r): r for r in setup_gpu_extra()}
    assert set(extra) == set(PINS) - {check.SOURCE_BUILT}
    assert all(extra[n] == f"{n}=={v}" for n, v in PINS.items() if n in extra)


def make_dry_run(target: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-B", target, "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return out.splitlines()


def test_install_gpu_constrains_every_install_and_builds_flash_attn_without_isolation():
    lines = make_dry_run("install-gpu")
    installs = [x for x in lines if " -m pip install " in x and "evalplus" not in x]
    assert installs and all("-c third_party/gpu_constraints.txt" in x for x in installs), installs
    assert "torch" == installs[0].split()[-1]  # torch first, from the constraints: no other torch comes first
    flash = [x for x in installs if "flash-attn==" in x]
    assert len(flash) == 1 and "--no-build-isolation" in flash[0] and f"flash-attn=={PINS['flash-attn']}" in flash[0]
    build = [x for x in installs if x.split()[-1] == "einops"]
    assert build and set(build[0].split()[-len(check.FLASH_ATTN_BUILD):]) == set(check.FLASH_ATTN_BUILD)
    assert lines.index(build[0]) < lines.index(flash[0])
    dropped = [x for x in lines if "pip uninstall" in x]
    assert dropped and set(dropped[0].split()[-len(check.DROPPED):]) == set(check.DROPPED)
    assert any("import torch, vllm, transformers, verl, flash_attn" in x for x in lines)


def test_committed_resolution_summary_is_for_these_pins():
    summary = (REPO / "third_party" / "gpu_install_check.txt").read_text()
    assert summary.splitlines()[0].endswith("RESOLVES"), summary
    for name, version in PINS.items():
        if name != check.SOURCE_BUILT:
            assert re.search(rf"ok +{re.escape(name)}=={re.escape(version)}\b", summary), (name, summary)
    assert f"flash-attn=={PINS['flash-attn']}" in summary


@pytest.mark.slow
def test_the_gpu_set_resolves_now(tmp_path):
    """The resolution against the package index (several minutes; what ``make check-gpu-install`` runs)."""
    out = tmp_path / "summary.txt"
    proc = subprocess.run([sys.executable, str(REPO / "third_party" / "gpu_install_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
