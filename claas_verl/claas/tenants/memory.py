"""Memory one tenant costs, from the LoRA the CLaaS recipes train: ``python -m claas_verl.claas.tenants.memory``
prints the table of docs/performance.md ("Memory per tenant"; ``tests/claas/tenants/test_tenant_memory.py`` holds
the page equal to it).

The parameter count is not a formula typed by hand: the model is built on PyTorch's meta device (shapes only, no
bytes) from the published configuration of each size, PEFT attaches the recipe's LoRA (``lora_rank``,
``target_modules`` of ``recipes/claas/common/base.yaml``), and the trainable parameters are counted. From ``P``:

- at rest, host memory (:class:`~claas_verl.claas.tenants.adapters.TenantAdapterStore`): the fp32 adapter and
  AdamW's two fp32 moments, ``12 P`` bytes (plus one step counter per parameter tensor);
- during its update, on the accelerator: adapter, gradient and both moments, ``16 P`` bytes in all, split over the
  FSDP ranks;
- served: one copy in the serving engine's dtype (bf16), ``2 P`` bytes per adapter slot.
"""

from __future__ import annotations

import argparse

import torch

#: the published shapes (config.json of the Hugging Face repositories) of the sizes the table covers; LoRA
#: counts do not depend on the vocabulary (PEFT's all-linear leaves the output layer out)
MODEL_SHAPES = {
    "1.5B (Qwen2.5-1.5B, DeepSeek-R1-Distill-Qwen-1.5B)": (
        "qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936)),
    "8B (Qwen3-8B)": (
        "qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936)),
}
RECIPE = "recipes/claas/common/base.yaml"
GIB = 1 << 30


def lora_parameter_count(model_type: str, shape: dict, rank: int, target_modules) -> int:
    """Trainable parameters of a LoRA of ``rank`` on ``target_modules`` (PEFT's spelling: a list or
    ``"all-linear"``) of a ``model_type`` model of ``shape``, built on the meta device."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(model, LoraConfig(r=int(rank), lora_alpha=2 * int(rank), target_modules=target_modules))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def recipe_lora(path: str = RECIPE) -> tuple[int, object]:
    """``(lora_rank, target_modules)`` of the CLaaS base recipe."""
    import yaml

    with open(path) as f:
        model = yaml.safe_load(f)["actor_rollout_ref"]["model"]
    return int(model["lora_rank"]), model["target_modules"]


def tenant_bytes(params: int) -> dict[str, int]:
    """Bytes of one tenant with ``params`` LoRA parameters (see the module doc)."""
    return {"params": params, "rest": 12 * params, "update": 16 * params, "served": 2 * params}


def memory_table(rank: int, target_modules) -> str:
    """The markdown table of docs/performance.md."""
    rows = {name: tenant_bytes(lora_parameter_count(kind, shape, rank, target_modules))
            for name, (kind, shape) in MODEL_SHAPES.items()}
    names = list(rows)
    lines = ["| per tenant | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label, fmt):
        lines.append(f"| {label} | " + " | ".join(fmt(rows[n]) for n in names) + " |")

    row(f"LoRA parameters (r = {rank}, {target_modules})", lambda r: f"{r['params']:,}")
    def gib(key):
        return lambda r: f"{r[key] / GIB:.3f} GiB"

    row("at rest, host memory: fp32 adapter + AdamW moments", gib("rest"))
    row("during its update, accelerator: + fp32 gradient (all ranks together)", gib("update"))
    row("served, per adapter slot (bf16)", gib("served"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=RECIPE, help="the recipe whose lora_rank and target_modules are used")
    args = parser.parse_args(argv)
    print(memory_table(*recipe_lora(args.recipe)))


if __name__ == "__main__":
    main()
