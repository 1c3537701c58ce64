"""Continual MOPD stage trainer on verl (MOPD paper; docs/math.md §B): ``register_trainer("mopd")``.

Importing :mod:`claas_verl.mopd.trainer.trainer` registers :class:`MOPDTrainer` with verl's v1 trainer
registry (``claas_verl.mopd.trainer.MOPDTrainer`` does it lazily, so the pure helpers such as ``fields``,
``plan_steps``, ``audit_trail``, ``resume_state`` and ``forgetting_table`` import without verl).
Entry point: ``python -m claas_verl.main_mopd --config-name mopd/<recipe>``.
Every coupling to private verl names lives in :mod:`claas_verl.mopd.trainer.verl_couplings`.
"""


def __getattr__(name: str):
    if name == "MOPDTrainer":
        from claas_verl.mopd.trainer.trainer import MOPDTrainer

        return MOPDTrainer
    raise AttributeError(name)


__all__ = ["MOPDTrainer"]
