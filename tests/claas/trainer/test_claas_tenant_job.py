"""The multi-tenant training job's configuration and driver-side parts (``claas/service_tenants``).

The recipe composes and passes every check; what a tenants job cannot do is refused before Ray with the key named;
each tenant's REINFORCE++ statistics see only its own rewards and are what the estimator reads for its update; the
checkpoint's pause reaches every tenant's sink; the buffer summary of a partitioned actor adds up the tenants'
clocks. The job itself (updates, verified reloads, resume) is ``test_claas_service_tenants_e2e.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
from omegaconf import open_dict
from test_claas_trainer_config import compose_recipe

from claas_verl.claas.trainer.checks import check_claas_config
from claas_verl.claas.trainer.config import ClaasConfig

TENANTS = ("alice", "bob", "carol")


@pytest.fixture(scope="module")
def tiny_tenants():
    cfg = compose_recipe("service_tenants scale=tiny")
    return cfg, ClaasConfig.from_config(cfg.claas)


def test_the_tenants_recipe_composes_with_one_partition_per_tenant(tiny_tenants, monkeypatch):
    cfg, claas = tiny_tenants
    check_claas_config(cfg, claas)
    assert claas.service.tenant_names == TENANTS and claas.service.max_loaded_adapters == 2
    parts = claas.service.directory.replay_partitions()
    assert parts == {t: {"b_min": 4, "b_max": 64, "a_max": 4} for t in TENANTS}
    # the paper-scale recipe reads each tenant's key from the environment, and says which one is missing
    monkeypatch.setenv("CLAAS_ALICE_KEY", "sk-a")
    monkeypatch.setenv("CLAAS_BOB_KEY", "sk-b")
    paper = ClaasConfig.from_config(compose_recipe("service_tenants").claas)
    assert paper.service.tenant_names == ("alice", "bob") and paper.service.directory.tenant_of("sk-b") == "bob"
    monkeypatch.delenv("CLAAS_BOB_KEY")
    with pytest.raises(Exception, match="CLAAS_BOB_KEY"):
        ClaasConfig.from_config(compose_recipe("service_tenants").claas)


@pytest.mark.parametrize("override, match", [
    ("claas.algorithm=ppo", r"per-tenant updates run reinforce_pp or sdpo \(a per-tenant PPO critic"),
    ("claas.producer.enabled=true", "claas.producer.enabled=false"),
    ("claas.service.tenants.bob.b_min=2", r"claas.service.tenants.bob: .*claas.m=4"),
    ("claas.service.max_loaded_adapters=0", r"claas.service.max_loaded_adapters must be an int >= 1"),
])
def test_what_a_tenants_job_cannot_do_is_refused_by_key(override, match):
    with pytest.raises(ValueError, match=match):
        ClaasConfig.from_config(compose_recipe("service_tenants scale=tiny", [override]).claas)


def test_a_tenants_job_needs_a_fresh_lora_adapter_and_no_critic(tiny_tenants):
    cfg, claas = tiny_tenants
    no_lora = cfg.copy()
    with open_dict(no_lora):
        no_lora.actor_rollout_ref.model.lora_rank = 0
    with pytest.raises(ValueError, match="one LoRA adapter per tenant"):
        check_claas_config(no_lora, claas)
    critic = cfg.copy()
    with open_dict(critic):
        critic.critic.enable = True
    with pytest.raises(ValueError, match="a multi-tenant job trains no critic"):
        check_claas_config(critic, claas)
    pretrained = cfg.copy()
    with open_dict(pretrained):
        pretrained.actor_rollout_ref.model.lora_adapter_path = "/ckpt/adapter"
    with pytest.raises(ValueError, match=r"lora_adapter_path='/ckpt/adapter': every tenant's version 0"):
        check_claas_config(pretrained, claas)


def test_each_tenants_ema_sees_only_its_rewards_and_is_bound_for_its_update():
    from claas_verl.claas import verl_losses
    from claas_verl.claas.trainer.config import RppConfig
    from claas_verl.claas.trainer.tenants_side import TenantEmas
    from claas_verl.losses.advantages import EmaRewardStats

    rpp = RppConfig()
    emas = TenantEmas(rpp, TENANTS)
    emas.update_many("alice", [1.0, 1.0, 1.0])
    emas.update_many("bob", [0.0])
    alone = EmaRewardStats(beta=rpp.beta, b0=rpp.b0, v0=rpp.v0, v_min=rpp.v_min)
    alone.update_many([1.0, 1.0, 1.0])
    state = emas.state_dict()
    assert state["alice"] == alone.state_dict()  # exactly the statistics of a job with alice alone
    assert state["carol"]["count"] == 0 and state["bob"]["count"] == 1
    metrics = emas.snapshot_for_step("alice")
    bound = verl_losses._BOUND_EMA_STATS  # what the claas_rpp_ema estimator reads
    assert bound is emas.bound and bound.baseline == alone.baseline == metrics["claas/ema_baseline"]
    bob = EmaRewardStats(beta=rpp.beta, b0=rpp.b0, v0=rpp.v0, v_min=rpp.v_min)
    bob.update_many([0.0])
    emas.snapshot_for_step("bob")
    assert bound.state_dict() == bob.state_dict() != alone.state_dict()
    with pytest.raises(ValueError, match="saved for tenants"):
        emas.load_state_dict({"alice": state["alice"]})


def test_a_checkpoint_pause_holds_every_tenants_writes():
    import concurrent.futures

    from claas_verl.claas.service.sinks import ActorSink
    from claas_verl.claas.trainer import resume as rs

    sent = []

    class Handle:
        def __init__(self):
            self.add = SimpleNamespace(remote=self._add)

        def _add(self, batch, tenant=None):
            fut = concurrent.futures.Future()
            fut.set_result(1)
            sent.append(tenant)
            return SimpleNamespace(future=lambda: fut)

    root = rs.pausable_sink(ActorSink)(Handle())
    alice, bob = root.for_tenant("alice"), root.for_tenant("bob")
    assert isinstance(alice, type(root)) and alice.tenant == "alice"
    with root.paused(timeout_s=5):
        queued = [alice.submit([object()]), bob.submit([object()])]
        assert sent == [] and not any(f.done() for f in queued)  # neither tenant's write reaches the buffer
    assert sorted(sent) == ["alice", "bob"] and [f.result(2) for f in queued] == [1, 1]


def test_the_buffer_summary_of_a_partitioned_actor_adds_the_tenants_clocks(ray_session):
    from claas_verl.claas.replay import ReplayEntry, make_replay_actor
    from claas_verl.claas.trainer.tenants_side import buffer_summary

    def entries(prefix, n):
        return [ReplayEntry(uid=f"{prefix}{i}", scenario_id=0, prompt_ids=[1, 2], response_ids=[3, 4],
                            behaviour_logprob=-1.0, reward=1.0, P=0) for i in range(n)]

    parts = {t: {"b_min": 1, "b_max": 8, "a_max": 4} for t in ("alice", "bob")}
    actor = make_replay_actor(partitions=parts, seed=0, max_restarts=0, adopt=False)
    ray.get(actor.add.remote(entries("a", 2), tenant="alice"))
    ray.get(actor.add.remote(entries("b", 1), tenant="bob"))
    for _ in range(3):
        ray.get(actor.on_update.remote(tenant="alice"))
    ray.get(actor.on_update.remote(tenant="bob"))
    got = buffer_summary(actor, ("alice", "bob"))
    assert (got["k"], got["size"]) == (4, 3)
    assert got["uids"] == ["a0", "a1", "b0"] and got["tenants"]["alice"]["k"] == 3
    ray.kill(actor)


def test_metrics_export_each_tenants_updates_version_wait_and_probe_alarm():
    from claas_verl.claas.service.metrics import ServiceMetrics

    training = {"bound": 1, "probe_failures_total": 2, "tenants": {
        "alice": {"granted": 5, "trained_version": 5, "probe_failures": 2, "waiting": None},
        "bob": {"granted": 3, "trained_version": 3, "probe_failures": 0, "waiting": 1}}}
    text = ServiceMetrics(lambda: {"counts": {}, "tenant_training": training}).render()[0].decode()
    for line in ('claas_tenant_updates_total{tenant="alice"} 5.0', 'claas_tenant_trained_version{tenant="bob"} 3.0',
                 'claas_tenant_probe_failures_total{tenant="alice"} 2.0',
                 'claas_tenant_waiting_updates{tenant="bob"} 1.0', 'claas_tenant_waiting_updates{tenant="alice"} 0.0'):
        assert line in text, line
