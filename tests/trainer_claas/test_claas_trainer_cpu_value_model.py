"""The CPU value-model shim: verl still has the function it wraps, and on CPU it builds an sdpa value model."""

from __future__ import annotations

import inspect

import torch


def test_patched_verl_function_still_exists_with_the_same_signature():
    import verl.utils.model as model_module

    import claas_verl.trainer.claas.cpu_value_model as shim

    fn = getattr(model_module, shim.PATCHED_NAME)  # fails loudly if verl renames/moves it
    params = list(inspect.signature(fn).parameters)
    assert params == ["local_path", "torch_dtype", "model_config", "trust_remote_code"]
    assert getattr(fn, "_claas_cpu_patch", False), "the post-import hook did not wrap verl's loader"


def test_cpu_value_model_loads_with_sdpa(monkeypatch):
    import verl.utils.model as model_module
    from transformers import AutoConfig

    import claas_verl.trainer.claas.cpu_value_model  # noqa: F401
    from claas_verl.tiny import ensure_tiny
    from claas_verl.verl_ext.cpu import patches

    monkeypatch.setattr(patches, "on_cpu_platform", lambda: True)
    path = str(ensure_tiny().student)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_labels = 1
    model = model_module.load_valuehead_model(path, torch.float32, cfg, False)
    assert model.config._attn_implementation == "sdpa"
    out = model(input_ids=torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, 1)  # one value per position
