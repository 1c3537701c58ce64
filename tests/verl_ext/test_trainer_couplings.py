"""The one list of private verl names the trainers use (claas_verl.verl_ext.trainer_couplings) is true of the installed
verl and complete (the import direction of the whole package: tests/test_import_cycles.py)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from claas_verl.verl_ext import trainer_couplings as vc


@pytest.mark.parametrize("c", vc.COUPLINGS, ids=lambda c: f"{c.owner}.{c.attr}")
def test_listed_name_exists(c):
    assert hasattr(vc.owner_object(c.module, c.owner), c.attr), (
        f"verl moved {c.module}.{c.owner}.{c.attr} ({', '.join(c.users)}: {c.why}); "
        "update claas_verl/verl_ext/trainer_couplings.py")


@pytest.mark.parametrize("m", vc.SOURCE_MARKERS, ids=lambda m: f"{m.owner}.{m.attr}:{m.marker[:30]}")
def test_listed_behaviour_still_in_verl_source(m):
    src = inspect.getsource(getattr(vc.owner_object(m.module, m.owner), m.attr))
    assert m.marker in src, f"{m.module}.{m.owner}.{m.attr} no longer contains {m.marker!r}"


@pytest.mark.parametrize("a", vc.INSTANCE_ATTRIBUTES, ids=lambda a: f"{a.owner}.{a.method}:{a.needle}")
def test_listed_instance_attribute_still_assigned(a):
    src = inspect.getsource(getattr(vc.owner_object(a.module, a.owner), a.method))
    assert f"{a.needle} =" in src, f"{a.owner}.{a.method} no longer assigns {a.needle}"


@pytest.mark.parametrize("system,module,cls", [("claas", "claas_verl.claas.trainer.trainer", "ClaasTrainer"),
                                               ("mopd", "claas_verl.mopd.trainer.trainer", "MOPDTrainer")])
def test_every_private_ppotrainer_method_a_trainer_overrides_is_listed(system, module, cls):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = getattr(importlib.import_module(module), cls)
    ours = [k for k in trainer.__mro__ if k.__module__.startswith("claas_verl.")]
    overridden = {name for k in ours for name, v in vars(k).items()
                  if name.startswith("_") and not name.startswith("__") and inspect.isfunction(v)
                  and hasattr(PPOTrainer, name)}
    listed = {attr for _, owner, attr in vc.couplings_of(system) if owner == "PPOTrainer"}
    assert overridden and overridden <= listed, f"{cls} overrides unlisted private verl methods: {overridden - listed}"


def test_pending_sync_metrics_reach_the_step_metrics():
    """CLaaS's on_step_end stores its buffer statistics in ``_pending_sync_metrics``; verl merges them into the
    step's metrics once and clears them."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = SimpleNamespace(_pending_sync_metrics={"claas/buffer_size": 7})
    assert PPOTrainer._consume_sync_metrics(trainer) == {"claas/buffer_size": 7}
    assert PPOTrainer._consume_sync_metrics(trainer) == {}


def test_trainer_mode_reads_sync_whatever_name_registered():
    from claas_verl.verl_ext.trainer_base import VerlSeams

    seams = VerlSeams()
    seams.trainer_mode = "claas"
    assert seams.trainer_mode == "sync" and seams.registered_mode == "claas"
