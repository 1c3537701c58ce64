"""The verl seams both trainers (CLaaS, MOPD) use, written once.

verl 0.9.1's v1 ``PPOTrainer`` has hooks for a step's phases but none for these; each is a private name of
verl, listed in :mod:`claas_verl.verl_ext.trainer_couplings` (whose tests fail by name after a verl upgrade):

* ``trainer_mode`` is both verl's registry key and its sync/async switch (async sampler, dataloader refill,
  TransferQueue checkpointing on any other name). :class:`VerlSeams` answers ``"sync"`` whatever name the
  trainer was registered under (the registered name is kept in ``registered_mode``).
* Extra checkpoint state: :class:`VerlSeams` wraps ``_save_checkpoint`` / ``_load_checkpoint`` and calls
  ``checkpoint_now`` (may defer verl's save), ``after_checkpoint_saved``, ``before_checkpoint_load`` and
  ``after_checkpoint_loaded``, so the state lands in verl's own ``global_step_N`` folder.
* Stopping verl's loop: ``fit`` runs while ``global_steps <= total_training_steps``, re-read every step;
  :meth:`VerlSeams.stop_after_this_step` / :meth:`VerlSeams.stop_before_first_step` end it there. verl decides
  ``is_last_step`` before the step runs, so a step ended from ``on_step_end`` is not saved by verl's last-step save:
  a trainer that stops itself takes its own final checkpoint.
* The worker swap: :func:`swap_actor_worker` gives every role verl maps to ``ActorRolloutRefWorker`` another
  worker class (after ``_init_resource_pool_mgr`` built ``role_worker_mapping``).
* No prompt dataset: :func:`drop_prompt_dataloader` replaces what ``_init_dataloader`` would build.
* Registering a trainer in verl's ``TaskRunner`` process: :func:`task_runner_class`.
* verl's progress bar: ``fit`` builds a ``tqdm`` over ``total_training_steps`` before ``on_train_begin``; a trainer
  whose step count is not known in advance (a stream-driven run) hides it with :func:`hidden_verl_progress_bar`
  (around ``fit``: verl's module-level ``tqdm`` name, its only use) and reports its own progress.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

from omegaconf import OmegaConf, open_dict

SYNC_MODE = "sync"


class VerlSeams:
    """Mixin placed before verl's ``PPOTrainer`` in a trainer's bases (see the module docstring)."""

    @property
    def trainer_mode(self) -> str:
        return SYNC_MODE

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self.registered_mode = value

    # ---- extra checkpoint state (override the four hooks; the defaults do nothing)
    def checkpoint_now(self) -> bool:
        """False defers verl's ``_save_checkpoint`` (the subclass takes it itself later)."""
        return True

    def after_checkpoint_saved(self) -> None:
        return None

    def before_checkpoint_load(self) -> None:
        return None

    def after_checkpoint_loaded(self) -> None:
        return None

    def _save_checkpoint(self):
        if not self.checkpoint_now():
            return None
        out = super()._save_checkpoint()
        self.after_checkpoint_saved()
        return out

    def _load_checkpoint(self):
        self.before_checkpoint_load()
        out = super()._load_checkpoint()
        self.after_checkpoint_loaded()
        return out

    # ---- ending verl's loop from a hook
    def stop_after_this_step(self) -> None:
        self.total_training_steps = self.global_steps

    def stop_before_first_step(self) -> None:
        """From ``on_train_begin`` (``fit`` already counted the first step): the loop body never runs."""
        self.total_training_steps = self.global_steps - 1


def swap_actor_worker(trainer: Any, worker_cls: type) -> None:
    """Every role verl maps to its ``ActorRolloutRefWorker`` runs ``worker_cls`` instead."""
    import ray
    from verl.trainer.ppo.utils import Role

    for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
        if role in trainer.role_worker_mapping:
            trainer.role_worker_mapping[role] = ray.remote(worker_cls)


class NoPromptLoader:
    """Stands in for verl's prompt dataloader where prompts come from elsewhere (it is checkpointed as ``{}``)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def drop_prompt_dataloader(trainer: Any, total_steps: int) -> None:
    """What verl's ``_init_dataloader`` sets, without a dataset: ``total_steps`` caps the loop (and the LR schedule);
    the epoch counter never advances."""
    trainer.train_dataset = trainer.val_dataset = None
    trainer.train_dataloader = NoPromptLoader()
    trainer.train_dataloader_it = None
    trainer.val_dataloader = NoPromptLoader()
    trainer.steps_per_epoch = 1 << 62
    trainer.total_training_steps = total_steps
    config = trainer.config
    with open_dict(config):
        config.trainer.total_epochs = 1
        if OmegaConf.select(config, "actor_rollout_ref.actor.optim") is not None:
            config.actor_rollout_ref.actor.optim.total_training_steps = total_steps
        if OmegaConf.select(config, "critic.optim") is not None:
            config.critic.optim.total_training_steps = total_steps


@contextlib.contextmanager
def hidden_verl_progress_bar() -> Iterator[None]:
    """Bars built by verl's trainer module inside the block are disabled (others, e.g. the rollout's, are not)."""
    from verl.trainer.ppo.v1 import trainer_base

    bar = trainer_base.tqdm
    trainer_base.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        trainer_base.tqdm = bar


def task_runner_class(trainer_module: str, agent_loop: bool = True):
    """verl's v1 ``TaskRunner`` (a Ray actor) whose ``run`` first imports ``trainer_module``.

    verl resolves ``trainer.v1.trainer_mode`` inside the TaskRunner's own Ray process, where only verl's plugins
    were imported; importing the module there (by name: it is imported in that process, not this one) is what
    registers the trainer. verl exposes the runner only as a Ray actor class, so the plain class is recovered from
    Ray's actor metadata. ``agent_loop=False`` skips verl's dataset-driven agent loop (and its worker actors).
    """
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__

    class TaskRunner(base):
        def run(self, config):
            importlib.import_module(trainer_module)
            return super().run(config)

        if not agent_loop:
            def init_agent_loop_manager(self):
                self.agent_loop_manager = None

    return ray.remote(TaskRunner)
