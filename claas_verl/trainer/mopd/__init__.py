"""Continual MOPD stage trainer on verl (003; SPEC Part B): ``register_trainer("mopd")``.

Importing this package registers :class:`MOPDTrainer` with verl's v1 trainer registry. Entry point:
``python -m claas_verl.main_mopd --config-name mopd/<recipe>``. Every coupling to private verl names lives in
:mod:`claas_verl.trainer.mopd.verl_couplings`.
"""

from claas_verl.trainer.mopd.trainer import MOPDTrainer

__all__ = ["MOPDTrainer"]
