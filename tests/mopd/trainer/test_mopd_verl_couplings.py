"""Every private verl name the MOPD trainer depends on still exists with the expected shape (fails loudly on a
verl upgrade that moves one), and the couplings behave as the trainer assumes."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from claas_verl.mopd.trainer import verl_couplings as vc
from claas_verl.verl_ext.trainer_couplings import owner_object


@pytest.mark.parametrize("module,owner,attr", vc.COUPLINGS)
def test_private_verl_name_exists(module, owner, attr):
    obj = owner_object(module, owner)
    assert hasattr(obj, attr), (
        f"verl moved {module}.{owner}.{attr}; claas_verl.mopd.trainer.verl_couplings overrides or reads it "
        "and must be updated for this verl version"
    )


def test_overridden_methods_keep_their_signatures():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    expected = {
        "_next_train_batch": ["self", "num_prompts"],
        "_compute_old_log_prob": ["self", "batch", "metrics"],
        "_compute_advantage": ["self", "batch", "metrics"],
        "_update_actor": ["self", "batch", "metrics"],
        "_save_checkpoint": ["self"],
        "_load_checkpoint": ["self"],
        "_init_dataloader": ["self"],
        "_init_resource_pool_mgr": ["self"],
        "_build_replay_buffer": ["self"],
        "_compute_metrics": ["self", "batch", "metrics", "timing_raw", "global_steps", "epoch"],
    }
    for name, params in expected.items():
        got = list(inspect.signature(getattr(PPOTrainer, name)).parameters)
        assert got == params, f"PPOTrainer.{name} changed its signature to {got}"
    # every private verl method the trainer overrides is a listed coupling whose signature is checked above
    from claas_verl.mopd.trainer.trainer import MOPDTrainer

    overridden = {n for n, v in vars(MOPDTrainer).items()
                  if n.startswith("_") and not n.startswith("__") and inspect.isfunction(v) and hasattr(PPOTrainer, n)}
    listed = {attr for _, owner, attr in vc.COUPLINGS if owner == "PPOTrainer"}
    assert overridden and overridden <= listed, overridden - listed
    assert overridden <= set(expected), overridden - set(expected)


@pytest.mark.parametrize("where,needle", vc.INSTANCE_ATTRIBUTES)
def test_instance_attributes_are_still_assigned(where, needle):
    owner, method = where.split(".")
    module = {
        "PPOTrainer": "verl.trainer.ppo.v1.trainer_base",
        "FSDPEngine": "verl.workers.engine.fsdp.transformer_impl",
        "ReplayBuffer": "verl.trainer.ppo.v1.replay_buffer",
        "WorkerGroup": "verl.single_controller.base.worker_group",
    }[owner]
    src = inspect.getsource(getattr(owner_object(module, owner), method))
    assert f"{needle} =" in src, f"{owner}.{method} no longer assigns {needle}"


def test_trainer_mode_switch_is_read_as_sync_and_base_uses_it():
    from verl.trainer.ppo.v1 import trainer_base

    src = inspect.getsource(trainer_base.PPOTrainer)
    # the base class branches on the attribute: keeping it "sync" is what keeps sync semantics
    assert 'self.trainer_mode == "sync"' in src and 'self.trainer_mode != "sync"' in src

    from claas_verl.mopd.trainer.trainer import MOPDTrainer

    p = MOPDTrainer.__new__(MOPDTrainer)  # no verl __init__: only the attribute's behaviour is looked at
    p.trainer_mode = "mopd"
    assert p.trainer_mode == "sync" and p.registered_mode == "mopd"


def test_engine_step_sequence_the_balanced_update_replaces_is_still_verl_s():
    """MOPDTrainingWorker shadows engine.train_batch for one call: verl must still call it from
    TrainingWorker.train_batch (itself called per mini-batch by train_mini_batch), and the base step must still be
    zero-grad -> forward_backward_batch -> optimizer_step (the sequence the balanced step re-runs with extra passes)."""
    from verl.workers.engine.base import BaseEngine
    from verl.workers.engine_workers import TrainingWorker

    assert "self.engine.train_batch(data, loss_function=self.loss_fn)" in inspect.getsource(TrainingWorker.train_batch)
    assert "self.train_batch(mini_batch_td)" in inspect.getsource(TrainingWorker.train_mini_batch)
    src = inspect.getsource(BaseEngine.train_batch)
    i, j, k = (src.index(x) for x in ("self.optimizer_zero_grad()", "self.forward_backward_batch(",
                                      "self.optimizer_step()"))
    assert i < j < k
    assert list(inspect.signature(BaseEngine.train_batch).parameters) == ["self", "data", "loss_function"]


def test_ref_conversion_mirrored_from_verl_is_still_verl_s():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    src = inspect.getsource(ActorRolloutRefWorker.init_model)
    for key in ("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"):
        assert key in src, f"verl's ref branch no longer renames {key}; update teacher_training_config"


def test_task_runner_class_recovers_verl_s_runner():
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__
    assert hasattr(base, "run") and hasattr(base, "init_agent_loop_manager")
    from claas_verl.main_mopd import mopd_task_runner_class

    runner = mopd_task_runner_class()
    assert hasattr(runner, "remote")


class _Engine:
    """Stand-in with verl's FSDPEngine attribute names (optimizer, lr_scheduler, checkpoint_manager)."""

    def __init__(self):
        self.module = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.1)
        self.lr_scheduler = self._build_lr_scheduler(self.optimizer)
        self.checkpoint_manager = type("C", (), {"lr_scheduler": self.lr_scheduler})()

    def _build_lr_scheduler(self, opt):
        # warm-up of 4 steps: lr = 0.1 * (step + 1) / 4 would restart at 0.025 after a reset
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))


def test_reset_engine_optimizer_gives_a_fresh_adamw_and_schedule():
    eng = _Engine()
    for _ in range(3):
        eng.module(torch.ones(1, 3)).sum().backward()
        eng.optimizer.step()
        eng.lr_scheduler.step()
    assert vc.optimizer_step_count(eng) == 3
    assert eng.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # (3+1)/4 = 1 -> full lr
    dropped = vc.reset_engine_optimizer(eng)
    assert dropped == 2  # weight and bias
    assert vc.optimizer_step_count(eng) == 0 and len(eng.optimizer.state) == 0
    assert eng.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # warm-up restarted: 0.1 * 1/4
    assert eng.checkpoint_manager.lr_scheduler is eng.lr_scheduler
    eng.module(torch.ones(1, 3)).sum().backward()
    eng.optimizer.step()
    assert vc.optimizer_step_count(eng) == 1  # the first step of the new stage is AdamW's step 1


def test_teacher_precision_follows_mopd_train_teacher_dtype(tiny_dir):
    """docs/math.md §B.1: teachers keep fp32 weights (FSDP param_dtype fp32) and run under bf16 autocast; verl ties the
    forward's autocast to param_dtype, so the built engine's autocast dtype is set to bf16 afterwards."""
    from hydra import compose, initialize_config_dir

    from claas_verl.main_mopd import runtime_args
    from claas_verl.paths import recipes_dir

    args = [*runtime_args(["+verl@_global_=gpu"]), "+verl@_global_=gpu", f"tiny_dir={tiny_dir}"]
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name="mopd/fsar_shared", overrides=["scale=tiny", "mopd.signal.window=16", *args])
    assert cfg.mopd.train.teacher_dtype == "fp32_bf16_autocast"
    student_mp = cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision
    assert (student_mp.param_dtype, student_mp.reduce_dtype) == ("bf16", "fp32")  # mapped from mopd.train
    expert = str(tiny_dir / "experts" / "math")
    for dtype, param in (("fp32_bf16_autocast", "fp32"), ("bf16", "bf16")):
        tc = vc.teacher_training_config(cfg.actor_rollout_ref, expert, dtype)
        assert tc.engine_config.mixed_precision["param_dtype"] == param and tc.engine_config.forward_only
    engine = types.SimpleNamespace(_autocast_dtype=torch.float32)  # what verl sets for param_dtype fp32
    vc.apply_teacher_dtype(engine, "fp32")
    assert engine._autocast_dtype == torch.float32
    vc.apply_teacher_dtype(engine, "fp32_bf16_autocast")
    assert engine._autocast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="teacher_dtype"):
        vc.apply_teacher_dtype(types.SimpleNamespace(), "fp32_bf16_autocast")


def test_sampler_poll_interval_comes_from_the_schema(monkeypatch):
    """verl's sampler keeps its ``poll_interval`` argument; the trainer sets it from ``MopdConfig.sampler_poll_s``
    (validated there: tests/mopd/test_mopd_config.py) on the sampler verl's ``_build_replay_buffer`` built."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from claas_verl.mopd.trainer.trainer import MOPDTrainer

    assert "poll_interval" in inspect.signature(ReplayBuffer.__init__).parameters
    sampler = SimpleNamespace(poll_interval=2.0)
    monkeypatch.setattr(PPOTrainerSync, "_build_replay_buffer", lambda self: sampler, raising=False)
    trainer = MOPDTrainer.__new__(MOPDTrainer)
    trainer.mopd = SimpleNamespace(sampler_poll_s=0.05)
    assert trainer._build_replay_buffer() is sampler and sampler.poll_interval == 0.05


def _adamw_step(eng):
    eng.optimizer.zero_grad()
    eng.module(torch.ones(1, 3)).sum().backward()
    eng.optimizer.step()


def test_a_separate_replay_state_steps_apart_from_the_stage_state_and_resets_with_it():
    # mopd.train.replay_optimizer=separate: two "main" steps, one "replay" step, one more "main" step. The replay state
    # starts fresh (AdamW step 1) and the main state continues at step 3 as if the replay step had its own optimizer;
    # the main state's moments equal those of a run with the two main-step gradients only.
    eng, ref = _Engine(), _Engine()
    ref.module.load_state_dict(eng.module.state_dict())
    _adamw_step(eng), _adamw_step(eng)
    assert vc.use_optimizer_state(eng, "replay") == 0  # fresh
    _adamw_step(eng)
    assert vc.optimizer_step_count(eng) == 1
    assert vc.use_optimizer_state(eng, "main") == 2
    assert vc.optimizer_step_count(eng) == 2
    # the gradient of this linear layer is the same at every θ, so the main state's moments are the reference's
    _adamw_step(ref), _adamw_step(ref)
    for p, q in zip(eng.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(eng.optimizer.state[p]["exp_avg"], ref.optimizer.state[q]["exp_avg"])
        torch.testing.assert_close(eng.optimizer.state[p]["exp_avg_sq"], ref.optimizer.state[q]["exp_avg_sq"])
    _adamw_step(eng)
    assert vc.optimizer_step_count(eng) == 3
    # a new stage empties both states, whichever is active
    vc.use_optimizer_state(eng, "replay")
    vc.reset_engine_optimizer(eng)
    assert len(eng.optimizer.state) == 0 and vc.use_optimizer_state(eng, "replay") == 0
    with pytest.raises(ValueError, match=r"optimizer state 'other': choose one of \['main', 'replay'\]"):
        vc.use_optimizer_state(eng, "other")
