"""Show the plan of a continual MOPD recipe before anything runs.

    python -m claas_verl.plan --config-name mopd/replay_kl [key=value ...]
    python -m claas_verl.plan --config-name mopd/tiny_seq plan.format=json

Composes the same Hydra config the trainer uses (recipes under ``claas_verl.schedule.recipes_dir()``,
overridable with ``$CLAAS_VERL_RECIPES``) and prints a per-stage summary (``plan.format=text``, the
default) or only the JSON document ``{"steps": [...]}`` in execution order (``plan.format=json``).
Only the ``mopd`` and ``plan`` sections are read, so recipes that also compose verl's ``ppo_trainer``
plan the same way. Invalid schedule keys exit with status 2 and a message naming the key.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from claas_verl.schedule import plan_from_config, recipes_dir

FORMATS = ("text", "json")
# Planning writes nothing: no Hydra output folder, no log files, nothing but the plan on stdout.
_QUIET = {
    "hydra.output_subdir": "null",
    "hydra.run.dir": ".",
    "hydra/job_logging": "disabled",
    "hydra/hydra_logging": "disabled",
}


def _run(cfg: DictConfig) -> None:
    plan_section = cfg.get("plan") or {}
    fmt = plan_section.get("format", "text")
    if fmt not in FORMATS:
        print(f"claas_verl.plan: error: plan.format must be one of {list(FORMATS)}, got {fmt!r}", file=sys.stderr)
        sys.exit(2)
    try:
        plan = plan_from_config(cfg)
    except ValueError as e:
        print(f"claas_verl.plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    if fmt == "json":
        print(json.dumps(plan.to_json_dict()))
    else:
        print(plan.summary())


def main() -> None:
    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:] if "=" in a}
    sys.argv += [f"{k}={v}" for k, v in _QUIET.items() if k not in given]
    hydra.main(config_path=str(recipes_dir()), config_name=None, version_base=None)(_run)()


if __name__ == "__main__":
    main()
