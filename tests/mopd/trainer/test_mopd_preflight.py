"""What ``main_mopd`` checks before Ray starts: every model of the plan, the checkpoint disk, and the runtime group
chosen from where the workers run (claas_verl.preflight)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from claas_verl.mopd.recipe_schedule import plan_from_config
from claas_verl.paths import recipes_dir
from claas_verl.preflight.disk import checkpoint_disk, checkpoint_steps
from claas_verl.preflight.models import model_path_problem, plan_model_keys
from claas_verl.preflight.runtime import runtime_for_nodes

REPO = Path(__file__).resolve().parents[3]


def compose_run(recipe: str, group: str, *overrides: str):
    """The config ``python -m claas_verl.main_mopd --config-name mopd/<recipe> +verl@_global_=<group>`` builds."""
    from claas_verl.main_mopd import runtime_args

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return compose(config_name=f"mopd/{recipe}", overrides=[*runtime_args([], group=group), *overrides])


# ------------------------------------------------------------------------------------------------ model paths
def test_every_model_of_the_paper_plan_is_checked_before_ray_starts(tiny_dir):
    """The paper's model group: hub ids and two experts left at ???; before, only a local-looking student was checked
    and the rest failed when its stage began, hours in."""
    from claas_verl.main_mopd import finalize_config

    cfg = compose_run("seq", "gpu", f"tiny_dir={tiny_dir}")
    with open_dict(cfg):
        for d in cfg.mopd.domains:
            cfg.mopd.domains[d].prompts = str(tiny_dir / "data" / "logic" / "train.parquet")
    with pytest.raises(ValueError) as err:
        finalize_config(cfg)
    msg = str(err.value)
    assert msg.startswith("6 model path(s) of the plan cannot be loaded")
    assert "mopd.student='deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B' is a Hugging Face hub id" in msg
    assert "huggingface-cli download deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --local-dir DIR" in msg
    assert "mopd.domains.code.expert is unset (???)" in msg and "mopd.domains.if.expert is unset (???)" in msg
    for d in ("logic", "math", "safety"):
        assert f"mopd.domains.{d}.expert=" in msg


def test_a_missing_expert_directory_is_named_with_the_tiny_hint(tiny_dir):
    from claas_verl.main_mopd import finalize_config

    cfg = compose_run("seq", "cpu", "scale=tiny", f"tiny_dir={tiny_dir}",
                      f"mopd.domains.code.expert={tiny_dir}/experts/nowhere")
    with pytest.raises(ValueError) as err:
        finalize_config(cfg)
    assert str(err.value).startswith("1 model path(s)")
    assert f"mopd.domains.code.expert='{tiny_dir}/experts/nowhere': no Hugging Face model there" in str(err.value)
    assert "python -m claas_verl.tiny make" in str(err.value)


def test_which_models_a_plan_loads(tiny_dir):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name="mopd/seq_recovery", overrides=["scale=tiny", "mopd.recovery.blocks_per_domain=2",
                                                                  f"tiny_dir={tiny_dir}"])
    plan = plan_from_config(cfg)
    keys = plan_model_keys(cfg, plan)
    assert keys == ["mopd.student", *(f"mopd.domains.{d}.expert" for d in plan.order)]
    assert model_path_problem("k", str(tiny_dir / "student")) is None
    assert "unset" in model_path_problem("k", "???") and "unset" in model_path_problem("k", None)
    assert "hub id" in model_path_problem("k", "Qwen/Qwen3-8B")
    assert "no config.json" in model_path_problem("k", str(tiny_dir))


# ------------------------------------------------------------------------------------------------ prompt lengths
def _agent_loop_length(tok, messages) -> int:
    """How verl's agent loop counts a text prompt: the chat template tokenized directly."""
    ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids)


def test_a_prompt_longer_than_max_prompt_length_is_refused_before_ray_starts(tiny_dir):
    """verl 0.9.1's agent loop keeps a too-long prompt's last tokens with only a log line (data.truncation: error no
    longer fires): the gym recipes trained `palin` on cut prompts for two bundle versions before this check."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from claas_verl.main_mopd import finalize_config

    tok = AutoTokenizer.from_pretrained(str(tiny_dir / "student"))
    cfg = compose_run("seq", "cpu", "scale=tiny", f"tiny_dir={tiny_dir}")
    plan = plan_from_config(cfg)
    rows = {d: plan.num_blocks[d] * int(cfg.mopd.block_size) for d in plan.order}
    longest = {d: max(_agent_loop_length(tok, m) for m in pq.read_table(
        str(cfg.mopd.domains[d].prompts)).column("prompt").to_pylist()[:rows[d]]) for d in plan.order}
    top = max(longest.values())
    worst = [d for d in plan.order if longest[d] == top][0]

    ok = compose_run("seq", "cpu", "scale=tiny", f"tiny_dir={tiny_dir}", f"mopd.train.max_prompt_length={top}",
                     "mopd.eval.enabled=false")
    finalize_config(ok)  # a prompt exactly at the limit fits

    cut = compose_run("seq", "cpu", "scale=tiny", f"tiny_dir={tiny_dir}", f"mopd.train.max_prompt_length={top - 1}",
                      "mopd.eval.enabled=false")
    with pytest.raises(ValueError) as err:
        finalize_config(cut)
    msg = str(err.value)
    assert f"mopd.domains.{worst}.prompts: " in msg and f"(longest {top} tokens with the chat template)" in msg
    assert f"set mopd.train.max_prompt_length={top} or more" in msg
    assert "test_prompts" not in msg  # the held-out prompts are read only when the evaluation is on
    for d in plan.order:
        assert (f"mopd.domains.{d}.prompts: " in msg) == (longest[d] > top - 1)


def test_a_prompt_file_without_the_prompt_key_column_names_the_key_and_the_fix(tiny_dir):
    from claas_verl.main_mopd import finalize_config

    cfg = compose_run("seq", "cpu", "scale=tiny", f"tiny_dir={tiny_dir}", "data.prompt_key=question")
    with pytest.raises(ValueError) as err:
        finalize_config(cfg)
    msg = str(err.value)
    first = plan_from_config(cfg).order[0]
    assert msg.startswith(f"mopd.domains.{first}.prompts=") and "has no column 'question' (data.prompt_key)" in msg
    assert "'prompt'" in msg and "set data.prompt_key to the column" in msg


def test_every_gym_prompt_fits_the_gym_recipes():
    """Each gym domain's train and held-out prompts, rendered as the agent loop renders them, fit in every gym
    recipe's max_prompt_length (`palin`'s 405-411 tokens were cut to 256 before)."""
    from claas_verl.preflight.prompts import prompt_token_lengths
    from claas_verl.tiny import gym

    tok = gym.byte_tokenizer()
    longest = {}
    for domain in gym.GYM_DOMAINS:
        train, test = gym.gym_rows(domain, 0)
        messages = [r["prompt"] for r in train + test]
        lengths = prompt_token_lengths(messages, tok, {})
        assert lengths[:3] == [_agent_loop_length(tok, m) for m in messages[:3]]
        longest[domain.name] = max(lengths)
    assert longest["palin"] > 256  # the old limit
    # the continual benchmark's eight methods (benchmarks/continual.py MOPD_FULL), each a recipe at scale=gym
    sys.path.insert(0, str(REPO))
    from benchmarks.continual_methods import SPELLINGS

    methods = [s.split() for m, s in SPELLINGS.items() if m.startswith("mopd/")]
    assert len(methods) == 8 and all("scale=gym" in m for m in methods)
    for recipe, *spelled in methods:
        cfg = compose_run(recipe.removeprefix("mopd/"), "cpu", *spelled)
        assert int(cfg.mopd.train.max_prompt_length) >= max(longest.values()), (recipe, longest)
        assert int(cfg.actor_rollout_ref.rollout.prompt_length) == int(cfg.mopd.train.max_prompt_length)


# ------------------------------------------------------------------------------------------------ checkpoint disk
@pytest.mark.parametrize("group", ["cpu", "gpu"])
def test_checkpoint_defaults_are_bounded(group, tiny_dir):
    cfg = compose_run("seq", group, "scale=tiny", f"tiny_dir={tiny_dir}")
    assert cfg.trainer.max_actor_ckpt_to_keep == 2 and cfg.trainer.save_freq == 5


def test_checkpoint_disk_counts_what_verl_writes_and_keeps(tiny_dir):
    cfg = compose_run("seq", "gpu", "scale=tiny", f"tiny_dir={tiny_dir}")
    plan = plan_from_config(cfg)  # stages of 4, 3, 3 steps
    assert checkpoint_steps([s.stage for s in plan.steps], 5) == [4, 5, 7, 10]  # stage ends + every 5th
    assert checkpoint_steps([1, 1, 1], -1) == [3]
    disk = checkpoint_disk(cfg, plan, params=10**9)
    assert (disk.saves, disk.kept, disk.on_disk, disk.snapshots) == (4, 2, 2, 3)
    assert disk.per_checkpoint == 14 * 10**9  # fp32 weights 4 + AdamW moments 8 + bf16 HF export 2
    assert disk.total == 2 * 14 * 10**9 + 3 * 2 * 10**9
    with open_dict(cfg):
        cfg.trainer.max_actor_ckpt_to_keep = None  # verl's own default: every checkpoint stays
    assert checkpoint_disk(cfg, plan, params=10**9).on_disk == 4
    with open_dict(cfg):
        cfg.trainer.max_actor_ckpt_to_keep = 1  # verl keeps the old one until the new one is written
    assert checkpoint_disk(cfg, plan, params=10**9, steps=4).on_disk == 1
    assert checkpoint_disk(cfg, plan, params=10**9).on_disk == 2


def test_plan_prints_the_checkpoint_disk(tiny_dir, tmp_path):
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny_dir),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-m", "claas_verl.plan", "--config-name", "mopd/seq", "scale=tiny",
                          "trainer.max_actor_ckpt_to_keep=3"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("checkpoint disk: ") and "3 of 4 checkpoints" in last and "keeping 3" in last, last
    assert list(tmp_path.iterdir()) == []  # still writes nothing


# ------------------------------------------------------------------------------------------------ runtime group
def test_runtime_follows_the_gpus_ray_detected():
    head = {"CPU": 8.0}
    gpu_worker = {"CPU": 32.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
    assert runtime_for_nodes([head, gpu_worker]) == "gpu"  # a GPU-less head (ray job submit runs the driver there)
    assert runtime_for_nodes([head, {"CPU": 16.0, "GPU": 1.0}]) == "cpu"  # logical GPUs of a CPU cluster
    assert runtime_for_nodes([head]) == "cpu"
    with pytest.raises(ValueError, match=r"ambiguous.*\+verl@_global_=gpu"):
        runtime_for_nodes([gpu_worker, {"CPU": 16.0, "GPU": 1.0}])


def test_main_mopd_joining_a_gpu_cluster_from_a_gpu_less_driver_picks_the_gpu_runtime():
    """A real local Ray cluster with a detected GPU (its accelerator_type resource), joined through ``RAY_ADDRESS`` as
    inside ``ray job submit``; this machine has no CUDA. Then a cluster of logical GPUs (a CPU cluster)."""
    script = textwrap.dedent("""
        import os, ray
        from claas_verl.main_mopd import runtime_args
        for extra in ({"accelerator_type:H200": 1}, {}):
            ray.init(address="local", num_cpus=1, num_gpus=1, resources=extra, include_dashboard=False,
                     logging_level="ERROR")
            os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
            print("GROUP", runtime_args([])[-1])
            ray.shutdown()
    """)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    groups = [x.split()[1] for x in proc.stdout.splitlines() if x.startswith("GROUP")]
    assert groups == ["+verl@_global_=gpu", "+verl@_global_=cpu"], proc.stdout + proc.stderr[-2000:]
    assert "has detected GPUs" in proc.stderr
