"""Continual multi-teacher on-policy distillation (MOPD): the system's glue on top of the shared math and verl glue.

``trainer/`` the stage trainer on verl's v1 trainer (its workers, the token and alignment passes, the audit trail);
``data/`` prompt files from raw datasets and the verl reward function; ``eval/`` benchmark evaluation of
checkpoints; ``merges/`` merges without training; ``verl_losses`` the registration of the top-k distillation loss
(``claas_verl.distill``) into verl. The math is in docs/math.md, Part B.
"""
