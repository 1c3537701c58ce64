"""The verl seams of :mod:`claas_verl.verl_ext.trainer_base`, run through verl's own ``PPOTrainer.fit``.

The couplings list checks that verl's private names and source lines still exist; these tests check what the
seams rely on them for: ``fit`` re-reads ``total_training_steps`` every step (so a hook can end the loop), its
progress bar is built from the module's ``tqdm`` name (so it can be hidden), ``save_freq`` goes through
``_save_checkpoint`` (so the extra-state hooks run inside verl's save), and ``_pending_sync_metrics`` reach the
step's metrics. verl's real ``fit`` runs on a trainer whose step produces no batch; nothing else is faked.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from claas_verl.verl_ext.trainer_base import (
    NoPromptLoader,
    VerlSeams,
    drop_prompt_dataloader,
    hidden_verl_progress_bar,
)

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")


@pytest.fixture(scope="module")
def verl_config():
    with initialize_config_dir(config_dir=os.path.abspath(RECIPES), version_base=None):
        cfg = compose(config_name="claas/reinforce_pp", overrides=["scale=tiny"])
    with open_dict(cfg):
        cfg.trainer.logger = []
        cfg.trainer.save_freq = 2
        cfg.trainer.test_freq = -1
        cfg.trainer.val_before_train = False
        cfg.trainer.rollout_data_dir = None
    return cfg


def _trainer(config, monkeypatch, *, stop_at=None, stop_before_first=False):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from claas_verl.verl_ext.trainer_base import SYNC_MODE

    monkeypatch.setattr(trainer_base, "tq", SimpleNamespace(kv_clear=lambda **_: None))
    events: list = []

    class Saver:  # what verl's _save_checkpoint would be, below the seam
        def _save_checkpoint(self):
            events.append(("verl_save", self.global_steps))

        def _load_checkpoint(self):
            events.append(("verl_load", self.global_steps))

    class Probe(VerlSeams, Saver, PPOTrainerSync):  # the base both trainers use
        def __init__(self):  # verl's __init__ builds Ray worker groups; fit needs none of them
            self.config = config
            self.global_steps = 0
            self._dump_futures = []
            self._dump_executor = SimpleNamespace(shutdown=lambda wait: None)
            drop_prompt_dataloader(self, total_steps=10**9)

        def on_train_begin(self):
            if stop_before_first:
                self.stop_before_first_step()

        def step(self, metrics, timing_raw):
            events.append(("step", self.global_steps))
            self._pending_sync_metrics = {"probe/step": self.global_steps}
            return SimpleNamespace(keys=[], partition_id="train")

        def on_step_end(self):
            if stop_at is not None and self.global_steps == stop_at:
                self.stop_after_this_step()

        def after_checkpoint_saved(self):
            events.append(("after_save", self.global_steps))

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            events.append(("metrics", global_steps, dict(metrics)))

        def on_train_end(self):
            events.append(("train_end", self.global_steps))

        def _reissue_inflight_prompts(self, partition_id="train"):
            assert self.trainer_mode == SYNC_MODE
            return 0

    trainer = Probe()
    trainer.trainer_mode = "claas"  # what verl's __init__ sets: the registered name
    return trainer, events


def test_a_hook_ends_verls_loop_after_the_step_it_runs_in(verl_config, monkeypatch):
    trainer, events = _trainer(verl_config, monkeypatch, stop_at=3)
    with hidden_verl_progress_bar():
        trainer.fit(agent_loop_manager=None)
    assert [e[1] for e in events if e[0] == "step"] == [1, 2, 3]
    # save_freq=2 goes through the seam: verl's save, then the extra state. verl fixes ``is_last_step`` before the
    # step runs, so the step a hook ends is NOT saved by verl: a trainer that stops itself saves itself
    # (the CLaaS trainer's ``ckpt.at_shutdown``).
    saves = [e for e in events if e[0] in ("verl_save", "after_save")]
    assert saves == [("verl_save", 2), ("after_save", 2)]
    assert events[-1] == ("train_end", 4)
    # the metrics hook sees what on_step_end left in _pending_sync_metrics, once per step
    assert [e[2].get("probe/step") for e in events if e[0] == "metrics"] == [1, 2, 3]
    assert trainer.registered_mode == "claas" and trainer.trainer_mode == "sync"


def test_a_hook_can_end_the_loop_before_its_first_step(verl_config, monkeypatch):
    trainer, events = _trainer(verl_config, monkeypatch, stop_before_first=True)
    trainer.fit(agent_loop_manager=None)
    assert not [e for e in events if e[0] == "step"]
    assert ("train_end", 1) in events


def test_verls_progress_bar_is_hidden_inside_the_block_only(verl_config, monkeypatch, capsys):
    trainer, _ = _trainer(verl_config, monkeypatch, stop_at=1)
    with hidden_verl_progress_bar():
        trainer.fit(agent_loop_manager=None)
    assert "Training Progress" not in capsys.readouterr().err
    trainer, _ = _trainer(verl_config, monkeypatch, stop_at=1)
    trainer.fit(agent_loop_manager=None)
    assert "Training Progress" in capsys.readouterr().err  # the bar this seam hides is verl's own


def test_no_prompt_dataloader_sets_everything_verls_init_dataloader_sets():
    """Whatever verl's ``_init_dataloader`` assigns on the trainer, ``drop_prompt_dataloader`` assigns too (a new
    attribute there would be read somewhere else in verl's loop and be missing)."""
    import ast
    import inspect
    import textwrap

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(PPOTrainer._init_dataloader)))
    verl_sets = {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    trainer = SimpleNamespace(config=None)
    from omegaconf import OmegaConf

    trainer.config = OmegaConf.create({"trainer": {}, "actor_rollout_ref": {"actor": {"optim": {}}}})
    drop_prompt_dataloader(trainer, total_steps=7)
    assert verl_sets <= set(vars(trainer)), f"verl's _init_dataloader also sets {verl_sets - set(vars(trainer))}"
    assert isinstance(trainer.train_dataloader, NoPromptLoader) and len(trainer.train_dataloader) == 0
    assert trainer.config.actor_rollout_ref.actor.optim.total_training_steps == 7
