"""Shared fixture: a tiny offline model + data directory for the verl_ext tests.

Uses ``claas_verl.tiny`` (the project's offline builder); built once per session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    existing = os.environ.get("CLAAS_TINY_DIR")
    if existing and (Path(existing) / "student" / "config.json").exists():
        return Path(existing)
    out = tmp_path_factory.mktemp("claas_tiny")
    subprocess.run([sys.executable, "-m", "claas_verl.tiny", "make", str(out)], check=True)
    return out
