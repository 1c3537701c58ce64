"""Continual multi-teacher on-policy distillation (MOPD): the system's glue on top of the shared math and verl glue.

``trainer/`` the stage trainer on verl's v1 trainer (its workers, the token and alignment passes, the audit trail);
``data/`` prompt files from raw datasets and the verl reward function; ``eval/`` benchmark evaluation of
checkpoints; ``merges/`` merges without training; ``verl_losses`` the registration of the top-k distillation loss
(``claas_verl.distill``) into verl. The math is in docs/math.md, Part B.

Importing this package schedules ``claas_topk_distill`` in verl's policy-loss registry for the moment verl's
``core_algos`` is imported; it imports no verl itself.
"""

from claas_verl.verl_ext import register_when_verl_loads


def _register_with_verl() -> None:
    from claas_verl.mopd import verl_losses  # noqa: F401  (its decorator registers the name)


register_when_verl_loads(_register_with_verl)
