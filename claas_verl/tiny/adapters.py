"""A LoRA adapter of the tiny student with random weights: what the demos, tests and benchmarks serve where a
trained adapter would stand (a trainer's published version, a tenant's adapter).

peft initialises ``lora_B`` to zero, which makes an adapter equal to its base model; ``init_lora_weights=False``
draws A and B at random so the adapter changes the policy, and ``b_scale`` moves it further (×20 puts the logits
well apart from the base model's, so a served reply tells which model produced it).
"""

from __future__ import annotations

from pathlib import Path


def random_lora_adapter(student: str | Path, out_dir: str | Path, *, seed: int = 0, rank: int = 4,
                        b_scale: float = 1.0):
    """Save a rank-``rank`` LoRA on the student's q/v projections (alpha = 2·rank) at ``out_dir``, drawn under
    ``torch.manual_seed(seed)``; returns the in-memory PEFT model (float32, eval mode)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    if b_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(b_scale)
    model.save_pretrained(str(out_dir))
    return model.eval()
