"""claas_verl.tiny.adapters: a random LoRA adapter of the tiny student, as the demos, tests and benchmarks serve it."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from claas_verl.tiny.adapters import random_lora_adapter


def _saved(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def test_the_adapter_is_drawn_by_its_seed_and_b_scale_multiplies_only_lora_b(tiny, tmp_path):
    model = random_lora_adapter(tiny.student, tmp_path / "a", seed=3)
    again = _saved(tmp_path / "a")
    random_lora_adapter(tiny.student, tmp_path / "b", seed=3, b_scale=20.0)
    far = _saved(tmp_path / "b")
    random_lora_adapter(tiny.student, tmp_path / "c", seed=4, rank=8)
    other = _saved(tmp_path / "c")
    assert not model.training and model.peft_config["default"].r == 4
    assert model.peft_config["default"].lora_alpha == 8 and set(model.peft_config["default"].target_modules) == {
        "q_proj", "v_proj"}
    b_keys = [k for k in again if "lora_B" in k]
    assert b_keys and all(again[k].abs().sum() > 0 for k in b_keys)  # not peft's zero init: it changes the policy
    for k, v in again.items():
        torch.testing.assert_close(far[k], v * 20.0 if "lora_B" in k else v, rtol=0, atol=0)
    assert {v.shape[0] for k, v in other.items() if "lora_A" in k} == {8}
