"""CPU-only shim so verl's critic (PPO value model) loads without flash-attn: monkeypatch P-claas-1.

verl 0.9.1's ``verl.utils.model.load_valuehead_model`` hard-codes ``attn_implementation="flash_attention_2"``
(both its ``AutoModelForTokenClassification`` path and its trl fallback), so the PPO critic cannot be
built on a CPU host. On the CPU platform only, this wraps the function to load the same
``AutoModelForTokenClassification`` value model with ``sdpa`` attention; elsewhere verl's function runs.

Loaded in every Ray worker through ``VERL_USE_EXTERNAL_MODULES=claas_verl.trainer.claas.cpu_value_model``
(``recipes/claas/tiny_ppo.yaml`` sets it). verl imports that module while it is still initialising, so
nothing verl is imported here: the patch is a post-import hook on ``verl.utils.model``.
``tests/trainer_claas/test_claas_trainer_cpu_value_model.py`` fails if verl renames the patched function.
(Belongs with the other CPU patches in ``claas_verl/verl_ext/cpu/patches.py``; kept here until moved.)
"""

from __future__ import annotations

import functools

PATCHED_MODULE = "verl.utils.model"
PATCHED_NAME = "load_valuehead_model"


def patch_valuehead_attention(model_module) -> None:
    original = getattr(model_module, PATCHED_NAME)
    if getattr(original, "_claas_cpu_patch", False):
        return

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from claas_verl.verl_ext.cpu.patches import on_cpu_platform

        if not on_cpu_platform():
            return original(local_path, torch_dtype, model_config, trust_remote_code)
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation="sdpa", trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._claas_cpu_patch = True
    setattr(model_module, PATCHED_NAME, load_valuehead_model)


def install() -> None:
    from claas_verl.verl_ext.cpu.patches import when_imported

    when_imported(PATCHED_MODULE, patch_valuehead_attention)


install()
