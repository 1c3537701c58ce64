"""CLaaS asynchronous replay trainer on verl: producers + replay-buffer actor + verl's v1 trainer.

``import claas_verl.claas.trainer.trainer`` registers ``trainer.v1.trainer_mode=claas`` (``main_claas`` does it
in the Ray task runner). The light pieces are importable without verl's trainer stack.
"""

from claas_verl.claas.trainer.config import ALGORITHMS, ClaasConfig
from claas_verl.claas.trainer.producer import BackgroundLoop, ChatRenderer, RolloutProducer
from claas_verl.claas.trainer.sampler import ClaasReplaySampler
from claas_verl.claas.trainer.tq_fields import entry_fields, entry_tag, replay_key

__all__ = [
    "ALGORITHMS", "BackgroundLoop", "ChatRenderer", "ClaasConfig", "ClaasReplaySampler", "RolloutProducer",
    "entry_fields", "entry_tag", "replay_key",
]
