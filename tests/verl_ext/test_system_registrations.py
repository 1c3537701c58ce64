"""Each system puts its own names into verl's registries: ``claas_verl.claas`` and ``claas_verl.mopd`` schedule them
when imported, ``claas_verl.verl_ext`` only offers the mechanism (``register_when_verl_loads``), and the package root
and the ``verl.plugins`` entry point import both systems, so every name resolves whichever is imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

POLICY_LOSSES = {"claas_seq_is": "compute_policy_loss_claas_seq_is",
                 "claas_seq_is_product": "compute_policy_loss_claas_seq_is_product",
                 "claas_topk_distill": "compute_policy_loss_claas_topk_distill"}
ADVANTAGES = {"claas_rpp_ema": "compute_claas_rpp_ema_advantage",
              "claas_rpp_global_whiten": "compute_claas_rpp_global_whiten_advantage"}

SNIPPET = """
import json, sys
if sys.argv[1] == "claas_verl":
    import claas_verl  # noqa: F401  (before verl: the registrations wait for core_algos)
from verl.trainer.ppo import core_algos as ca  # with "verl" first, only the verl.plugins entry point loads claas_verl
names = json.loads(sys.argv[2])
print(json.dumps({
    "policy": {n: ca.get_policy_loss_fn(n).__qualname__ for n in names["policy"]},
    "adv": {n: ca.get_adv_estimator_fn(n).__qualname__ for n in names["adv"]},
}))
"""


@pytest.mark.parametrize("first", ["claas_verl", "verl"])
def test_both_systems_names_resolve_in_a_fresh_interpreter(first):
    names = json.dumps({"policy": list(POLICY_LOSSES), "adv": list(ADVANTAGES)})
    out = subprocess.run([sys.executable, "-c", SNIPPET, first, names], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"policy": POLICY_LOSSES, "adv": ADVANTAGES}


def test_registration_runs_at_once_when_verl_is_already_loaded():
    from verl.trainer.ppo import core_algos  # noqa: F401

    from claas_verl.verl_ext import register_when_verl_loads

    calls = []
    register_when_verl_loads(lambda: calls.append("registered"))
    assert calls == ["registered"]

