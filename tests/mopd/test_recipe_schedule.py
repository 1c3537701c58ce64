"""The schedule of a composed recipe: OmegaConf read and prompt files counted by the MOPD layer, not the planner."""

import json

import pytest
from omegaconf import OmegaConf

from claas_verl.mopd.recipe_schedule import count_prompt_rows, plan_from_config, schedule_from_dict


def test_block_count_from_prompt_files_floors_partial_blocks(tmp_path):
    # 10 jsonl rows / block_size 4 -> 2 full blocks (the partial third block of 2 prompts is dropped)
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(10)))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": [str(i) for i in range(12)]}), tmp_path / "logic.parquet")  # 12/4 = 3
    (tmp_path / "code.json").write_text(json.dumps([{"prompt": "a"}] * 5))
    assert count_prompt_rows(tmp_path / "math.jsonl") == 10
    assert count_prompt_rows("code.json", base_dir=tmp_path) == 5
    cfg = schedule_from_dict({
        "order": ["logic", "math"], "block_size": 4,
        "domains": {"logic": {"prompts": "logic.parquet"}, "math": {"prompts": str(tmp_path / "math.jsonl")}},
    }, base_dir=tmp_path)
    assert cfg.num_blocks == {"logic": 3, "math": 2}
    with pytest.raises(ValueError, match=r"mopd\.domains\.math\.prompts"):
        schedule_from_dict({"order": ["math"], "block_size": 11,
                            "domains": {"math": {"prompts": str(tmp_path / "math.jsonl")}}})
    with pytest.raises(ValueError, match=r"mopd\.domains\.code\.prompts.*does not exist"):
        schedule_from_dict({"order": ["code"], "domains": {"code": {"prompts": str(tmp_path / "no.jsonl")}}})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"mopd\.domains\.code\.prompts: bad\.json must hold a JSON list"):
        schedule_from_dict({"order": ["code"], "domains": {"code": {"prompts": "bad.json"}}}, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"mopd\.domains\.code\.prompts: cannot count prompts in 'p\.csv'"):
        (tmp_path / "p.csv").write_text("a\n")
        schedule_from_dict({"order": ["code"], "domains": {"code": {"prompts": "p.csv"}}}, base_dir=tmp_path)


def test_plan_of_a_recipe_node_resolves_interpolations_and_names_a_missing_section():
    root = OmegaConf.create({"n": 2, "mopd": {"order": ["a", "b"], "block_size": 4,
                                              "domains": {"a": {"num_blocks": "${n}", "prompts": "???"},
                                                          "b": {"num_blocks": 1}}}})
    plan = plan_from_config(root)
    assert plan.num_blocks == {"a": 2, "b": 1} and len(plan) == 3
    with pytest.raises(ValueError, match="mopd: the config has no `mopd` section"):
        plan_from_config(OmegaConf.create({"trainer": {}}))
