"""Every repository path, module and recipe the user docs name exists (README.md and docs/*.md).

A renamed file or recipe leaves the page that names it behind; this finds it. The history in benchmarks/LOG.md is
not checked: it may name what was since removed.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a path into the repository: a top-level folder, then path characters; an optional "../" prefix (links from docs/)
_PATH = re.compile(
    r"(?<![\w./$-])(?:\.\./)*((?:claas_verl|benchmarks|recipes|tests|examples|docs|third_party|\.ci)/[\w./-]*)")
# a placeholder or a glob right after the match makes it a pattern, not a path (`recipes/mopd/gym_*`, `DIR/<x>`)
_PATTERN_TAIL = set("*<{$…[")
# upstream files the docs cite by their path in another repository
UPSTREAM = {"examples/gspo_trainer/run_qwen30b_gspo.sh"}  # verl's, docs/math.md
_MODULE = re.compile(r"python -m (claas_verl[\w.]*)")
_CONFIG_NAME = re.compile(r"--config-name[= ]([\w/]+)(\S?)")


def _pages():
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in PAGES]


def named_paths(text):
    """The repository paths ``text`` names, without the patterns (globs, ``<placeholder>``s)."""
    out = set()
    for m in _PATH.finditer(text):
        if text[m.end():m.end() + 1] in _PATTERN_TAIL:
            continue
        out.add(m.group(1).rstrip(".,;:"))
    return out


def test_named_paths_reads_paths_and_skips_patterns():
    text = ("see `claas_verl/losses/seq_is.py`, [x](../benchmarks/LOG.md), recipes/mopd/gym_* and "
            "`benchmarks/results/<run>/`, then `tests/claas/replay/`.")
    assert named_paths(text) == {"claas_verl/losses/seq_is.py", "benchmarks/LOG.md", "tests/claas/replay/"}


@pytest.mark.parametrize("page,text", _pages(), ids=[p.name for p in PAGES])
def test_every_named_path_exists(page, text):
    missing = sorted(p for p in named_paths(text) - UPSTREAM if not (ROOT / p).exists())
    assert not missing, f"{page} names paths that do not exist: {missing} (fix the page or the path)"


@pytest.mark.parametrize("page,text", _pages(), ids=[p.name for p in PAGES])
def test_every_python_m_module_exists(page, text):
    def exists(module):
        rel = Path(*module.split("."))
        return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()

    missing = sorted({m for m in _MODULE.findall(text) if not exists(m.rstrip("."))})
    assert not missing, f"{page} runs modules that do not exist: {missing}"


# Recipe names in commands. Kept apart from the paths above so that a recipe rename can update it alone.
@pytest.mark.parametrize("page,text", _pages(), ids=[p.name for p in PAGES])
def test_every_config_name_is_a_recipe(page, text):
    missing = []
    for line in text.splitlines():
        if "--config-path" in line:  # verl's own main_ppo reads its recipe from the given folder
            continue
        missing += [n for n, tail in _CONFIG_NAME.findall(line)  # skip placeholders: RECIPE, mopd/gym_<method>
                    if not n.isupper() and tail not in _PATTERN_TAIL
                    and not (ROOT / "recipes" / f"{n}.yaml").exists()]
    assert not missing, f"{page} names recipes that do not exist: {sorted(set(missing))}"
