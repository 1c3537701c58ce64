"""A saved LoRA adapter of the tiny student far from the base model, and the trainer's forward of it: the tenants'
serving tests tell one tenant's version from another's and from the base by their outputs."""

from __future__ import annotations

import torch

from claas_verl.tiny.adapters import random_lora_adapter


def far_adapter(tiny, out, seed: int):
    """``(adapter dir, the PEFT model of that saved adapter)``: r 4 on q/v, lora_B scaled ×20 (far from the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    random_lora_adapter(tiny.student, out, seed=seed, b_scale=20.0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny.student), dtype=torch.float32).eval()
    return str(out), PeftModel.from_pretrained(base, str(out)).eval()
