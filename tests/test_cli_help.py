"""Every ``python -m claas_verl.<cmd> --help`` exits 0 and names what can be run: the argparse commands their
subcommands, the Hydra entry points their recipes (listed without importing verl or probing for a Ray cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# command -> words its --help must show (subcommands; for the Hydra entry points, recipes of their system)
EXPECTED = {
    "mopd.data": ["mopd"],
    "mopd.eval": ["report", "--model"],
    "mopd.merges": ["ties", "average"],
    "tiny": ["make", "info", "gym"],
    "plan": ["replay_kl", "scale: gym, paper, tiny"],
    "main_mopd": ["replay_kl", "scale: gym, paper, tiny", "docs/config.md"],
    "main_claas": ["reinforce_pp", "sdpo", "scale: gym, paper, tiny", "docs/config.md"],
    "config_docs": ["--check", "docs/config.md"],
}


def _entry_points() -> set[str]:
    """``claas_verl.<cmd>`` modules meant for ``python -m``: a package ``__main__`` or a top-level module that
    calls ``main()`` under ``if __name__ == "__main__"``."""
    pkg = REPO / "claas_verl"
    found = {".".join(p.parent.relative_to(pkg).parts) for p in pkg.rglob("__main__.py")}
    found |= {p.stem for p in pkg.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    return found


def test_every_entry_point_is_checked():
    assert _entry_points() == set(EXPECTED)


def test_help_exits_zero_and_lists_subcommands():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    procs = {cmd: subprocess.Popen([sys.executable, "-m", f"claas_verl.{cmd}", "--help"], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in EXPECTED}
    for cmd, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"python -m claas_verl.{cmd} --help exited {proc.returncode}:\n{out}"
        missing = [w for w in EXPECTED[cmd] if w not in out]
        assert not missing, f"python -m claas_verl.{cmd} --help does not name {missing}:\n{out}"
    print(f"{len(procs)} --help commands in {time.monotonic() - t0:.1f}s")


def test_hydra_help_without_recipe_imports_no_verl():
    """Listing the recipes is instant: verl is imported only once a recipe is composed and run."""
    code = ("import sys; sys.argv = ['main_mopd', '--help']\n"
            "import claas_verl.main_claas, claas_verl.main_mopd, claas_verl.plan\n"
            "from claas_verl.main_mopd import runtime_args\n"
            "assert runtime_args(['--help']) == []\n"
            "assert runtime_args(['--config-name', 'mopd/seq', 'scale=tiny', '--help'], group='cpu')\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray'))\n"
            "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
