"""A saved LoRA adapter of the tiny student far from the base model, and the trainer's forward of it: the tenants'
serving tests tell one tenant's version from another's and from the base by their outputs."""

from __future__ import annotations

import torch


def far_adapter(tiny, out, seed: int):
    """``(adapter dir, the PEFT model of that saved adapter)``: r 4 on q/v, lora_B scaled ×20 (far from the base)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(str(tiny.student), dtype=torch.float32).eval()

    torch.manual_seed(seed)
    model = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    model.save_pretrained(str(out))
    return str(out), PeftModel.from_pretrained(base(), str(out)).eval()
