"""The verl keys a MOPD step depends on (claas_verl.mopd.trainer.config_checks): pure python, hand-checked cases."""

from __future__ import annotations

import pytest

from claas_verl.mopd.config_train import check_teacher_dtype
from claas_verl.mopd.trainer.config_checks import check_one_update_per_step


def test_one_update_per_plan_step_is_enforced_with_the_keys_named():
    check_one_update_per_step(32, 32, 1)
    with pytest.raises(ValueError, match=r"ppo_mini_batch_size=8 must equal mopd.block_size=32"):
        check_one_update_per_step(32, 8, 1)  # verl would run 4 AdamW steps per plan step
    with pytest.raises(ValueError, match=r"ppo_epochs"):
        check_one_update_per_step(32, 32, 2)
    assert check_teacher_dtype("fp32_bf16_autocast") == "fp32_bf16_autocast"
    with pytest.raises(ValueError, match="mopd.train.teacher_dtype"):
        check_teacher_dtype("fp16")
