"""Every private verl 0.9.1 name the CLaaS trainer relies on still exists (fails by name after a verl upgrade)."""

from __future__ import annotations

import inspect

import pytest
import torch

from claas_verl.claas.trainer import verl_couplings as vc
from claas_verl.verl_ext.trainer_couplings import owner_object


@pytest.mark.parametrize("module,owner,attr", vc.COUPLINGS)
def test_coupled_name_exists(module, owner, attr):
    cls = owner_object(module, owner)
    assert hasattr(cls, attr), f"verl moved {module}.{owner}.{attr}; update claas_verl/claas/trainer/verl_couplings.py"


@pytest.mark.parametrize("module,owner,attr,marker", vc.SOURCE_MARKERS)
def test_coupled_behaviour_still_in_verl_source(module, owner, attr, marker):
    src = inspect.getsource(getattr(owner_object(module, owner), attr))
    assert marker in src, f"{module}.{owner}.{attr} no longer contains {marker!r}"


class _Engine:
    """Stands in for verl's engine: optimizer_step returns a gradient norm."""

    def __init__(self, norm):
        self.norm, self.steps, self.zeroed = norm, 0, 0

    def optimizer_step(self):
        self.steps += 1
        return torch.tensor(self.norm)

    def optimizer_zero_grad(self):
        self.zeroed += 1


@pytest.mark.parametrize("norm,skip,applied,steps", [(1.5, False, True, 1), (float("nan"), False, False, 1),
                                                     (1.5, True, False, 0)])
def test_shadow_optimizer_step_records_and_restores(norm, skip, applied, steps):
    engine = _Engine(norm)
    with vc.shadow_optimizer_step(engine, skip=skip) as state:
        engine.optimizer_step()
    assert state["applied"] is applied and engine.steps == steps
    assert engine.zeroed == (1 if skip else 0)  # a skipped step clears the gradients
    assert "optimizer_step" not in vars(engine)  # the class method is back
