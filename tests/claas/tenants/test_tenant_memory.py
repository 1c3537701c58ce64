"""The memory-per-tenant table: parameter counts from a model built on the meta device, equal to the hand formula
at a small shape, and the docs page equal to the module's output for the recipe's LoRA."""

from __future__ import annotations

from pathlib import Path

from claas_verl.claas.tenants.memory import lora_parameter_count, memory_table, recipe_lora, tenant_bytes

REPO = Path(__file__).resolve().parents[3]


def test_the_meta_count_matches_the_formula_at_a_small_shape():
    # Qwen3 layer, hidden 64, 4 query heads and 2 kv heads of 16, MLP 96, 3 layers, r = 4 on every linear layer:
    # q 64->64, k 64->32, v 64->32, o 64->64, gate/up 64->96, down 96->64; LoRA of r on (in, out) holds r (in + out)
    per_layer = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 96) + (96 + 64))
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128)
    assert lora_parameter_count("qwen3", shape, 4, "all-linear") == 3 * per_layer
    assert lora_parameter_count("qwen3", shape, 4, ["q_proj", "v_proj"]) == 3 * 4 * ((64 + 64) + (64 + 32))
    assert tenant_bytes(10) == {"params": 10, "rest": 120, "update": 160, "served": 20}


def test_the_docs_table_is_the_modules_output_for_the_recipes_lora():
    rank, targets = recipe_lora(str(REPO / "recipes/claas/common/base.yaml"))
    assert (rank, targets) == (16, "all-linear")
    page = (REPO / "docs/performance.md").read_text()
    assert memory_table(rank, targets) in page, "regenerate: python -m claas_verl.claas.tenants.memory"
