"""Show the plan of a continual MOPD recipe before anything runs.

    python -m claas_verl.plan --config-name mopd/replay_kl [key=value ...]
    python -m claas_verl.plan --config-name mopd/seq scale=tiny plan.format=json

Composes the same Hydra config the trainer uses (recipes under ``claas_verl.paths.recipes_dir()``,
overridable with ``$CLAAS_VERL_RECIPES``, with the verl runtime group ``gpu`` unless the command line names one:
``+verl@_global_=cpu``) and prints a per-stage summary and the checkpoint disk the run needs
(``plan.format=text``, the default; :mod:`claas_verl.preflight.disk`, from the student's size and the
``trainer.save_freq`` / ``trainer.max_actor_ckpt_to_keep`` / ``save_contents`` keys, which can be overridden here
as on ``main_mopd``) or only the JSON document ``{"steps": [...]}`` in execution order (``plan.format=json``).
Invalid schedule keys exit with status 2 and a message naming the key.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from claas_verl.mopd.recipe_schedule import plan_from_config
from claas_verl.paths import recipes_dir

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
        print(disk_summary(cfg, plan))


def disk_summary(cfg: DictConfig, plan) -> str:
    """The checkpoint disk line of the text plan (needs the student's size: a local model directory)."""
    from claas_verl.preflight.disk import checkpoint_disk, parameter_count
    from claas_verl.preflight.models import model_path_problem

    student = str(cfg.mopd.get("student"))
    problem = model_path_problem("mopd.student", student)
    if problem or "trainer" not in cfg:
        return (f"checkpoint disk: unknown ({problem or 'no verl runtime group composed'}); 14 bytes per student "
                "parameter and kept checkpoint + 2 per parameter and stage")
    steps = cfg.trainer.get("total_training_steps")
    return checkpoint_disk(cfg, plan, parameter_count(student), steps=int(steps) if steps else None).summary()


def main() -> None:
    from claas_verl.main_mopd import runtime_args

    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:] if "=" in a}
    sys.argv += [f"{k}={v}" for k, v in _QUIET.items() if k not in given]
    sys.argv += runtime_args(sys.argv[1:], group="gpu")  # the checkpoint keys live in the runtime group
    hydra.main(config_path=str(recipes_dir()), config_name=None, version_base=None)(_run)()


if __name__ == "__main__":
    main()
