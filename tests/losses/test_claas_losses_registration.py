"""The CLaaS losses and estimators resolve through verl's registries: in-process with a real ActorConfig,
in a fresh subprocess after ``import claas_verl``, and inside a Ray worker; cross-checks against verl."""

import os
import subprocess
import sys

import pytest
import torch

import claas_verl.claas.verl_losses as glue
from claas_verl.losses import EmaRewardStats, seq_is_clipped_loss

NAMES_SNIPPET = (
    "import claas_verl; from verl.trainer.ppo import core_algos as ca; "
    "print(ca.get_policy_loss_fn('claas_seq_is').__qualname__,"
    " ca.get_policy_loss_fn('claas_seq_is_product').__qualname__,"
    " ca.get_adv_estimator_fn('claas_rpp_ema').__qualname__)"
)
EXPECTED = "compute_policy_loss_claas_seq_is compute_policy_loss_claas_seq_is_product compute_claas_rpp_ema_advantage"


@pytest.fixture(scope="module")
def actor_config():
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.1,
                       clip_ratio_high=0.3, clip_ratio_c=2.5, use_torch_compile=False)


def _batch(seed, B=4, T=5, one_token=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.ones(B, dtype=torch.long) if one_token else torch.tensor([5, 3, 4, 1])[:B]
    mask = (torch.arange(T) < lengths[:, None]).float()
    logp = torch.randn(B, T, generator=g) * 0.3 - 1
    old = logp + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return old, logp, adv, mask


def test_registered_fn_via_verl_reads_actor_config(actor_config):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    fn = get_policy_loss_fn("claas_seq_is")
    old, logp, adv, mask = _batch(0)
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask.bool(),
                       loss_agg_mode="token-mean", config=actor_config, rollout_is_weights=None)
    ref, ref_m = seq_is_clipped_loss(logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.5)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7)
    assert metrics == ref_m and all(isinstance(v, float) for v in metrics.values())
    # global_batch_info (set by verl's ppo_loss) is honoured: dp_size 2 and a global token count of 2·Σm halve nothing
    actor_config.global_batch_info.update(dp_size=2, batch_num_tokens=float(mask.sum() * 2), global_batch_size=8,
                                          loss_scale_factor=None)
    try:
        sharded, _ = fn(old, logp, adv, mask.bool(), "token-mean", actor_config, None)
    finally:
        actor_config.global_batch_info.clear()
    assert sharded.item() == pytest.approx(ref.item(), abs=1e-6)  # Σ/(2N)·2 = Σ/N


def test_geo_mean_equals_verl_gspo_when_dual_clip_cannot_fire(actor_config):
    # A > 0 everywhere: no dual clip; verl GSPO is the same GSPO-token construction.
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, logp, adv, mask = _batch(1)
    adv = adv.abs() + 0.1
    ours, _ = get_policy_loss_fn("claas_seq_is")(old, logp, adv, mask, "token-mean", actor_config, None)
    theirs, _ = get_policy_loss_fn("gspo")(old, logp, adv, mask, "token-mean", actor_config, None)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)


def test_product_equals_verl_vanilla_for_one_token_responses(actor_config):
    # one valid token: the trajectory ratio IS the token ratio, so the two losses (dual clip included) agree.
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, logp, adv, mask = _batch(2, B=4, one_token=True)
    old[:, 0] = logp[:, 0] + torch.tensor([1.5, -1.5, 0.05, -2.0])  # hit high, low, none and dual branches
    adv[:, 0] = torch.tensor([-1.0, 1.0, 0.5, -2.0])
    lp1 = logp.clone().requires_grad_()
    lp2 = logp.clone().requires_grad_()
    ours, m = get_policy_loss_fn("claas_seq_is_product")(old, lp1, adv, mask, "token-mean", actor_config, None)
    theirs, vm = get_policy_loss_fn("vanilla")(old, lp2, adv, mask, "token-mean", actor_config, None)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-6)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(vm["actor/pg_clipfrac_lower"], abs=1e-6)


def test_adv_estimators_through_verl_registry():
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).float()
    R = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    fn = get_adv_estimator_fn("claas_rpp_ema")
    glue.bind_rpp_ema_stats(None)
    with pytest.raises(ValueError, match="bind_rpp_ema_stats"):
        fn(token_level_rewards=R, response_mask=mask, config=AlgoConfig())
    stats = EmaRewardStats()  # b = 0.5, v = 0.25 → A = ±0.5/0.5 = ±1
    glue.bind_rpp_ema_stats(stats)
    try:
        adv, ret = fn(token_level_rewards=R, response_mask=mask, config=AlgoConfig(), index=None)
    finally:
        glue.bind_rpp_ema_stats(None)
    assert adv.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
    assert ret.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # global_whiten agrees with verl's reinforce_plus_plus where verl is defined
    ours, _ = get_adv_estimator_fn("claas_rpp_global_whiten")(token_level_rewards=R, response_mask=mask,
                                                               config=AlgoConfig())
    theirs, _ = get_adv_estimator_fn("reinforce_plus_plus")(token_level_rewards=R, response_mask=mask,
                                                            config=AlgoConfig())
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_names_resolve_in_fresh_subprocess():
    out = subprocess.run([sys.executable, "-c", NAMES_SNIPPET], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == EXPECTED


def test_names_resolve_inside_ray_worker(ray_session):
    ray = ray_session

    # A local function: cloudpickle ships it by value (the test module is not importable in the worker).
    def names_in_worker():
        import importlib

        importlib.import_module("claas_verl")  # first: schedules the registration before verl is imported
        from verl.trainer.ppo import core_algos as ca

        return " ".join([ca.get_policy_loss_fn("claas_seq_is").__qualname__,
                         ca.get_policy_loss_fn("claas_seq_is_product").__qualname__,
                         ca.get_adv_estimator_fn("claas_rpp_ema").__qualname__])

    assert ray.get(ray.remote(num_cpus=1)(names_in_worker).remote(), timeout=300) == EXPECTED


def test_rpp_ema_on_policy_state_from_the_config():
    """``algorithm.claas_rpp_ema`` (verl's own trainer): the batch's rewards are folded in, then b, v are read."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).float()
    R = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # r = (1, 0)
    fn = get_adv_estimator_fn("claas_rpp_ema")
    glue.bind_rpp_ema_stats(None)
    glue._ON_POLICY_STATS = None
    cfg = OmegaConf.create({"adv_estimator": "claas_rpp_ema", "claas_rpp_ema": {"beta": 0.5}})
    try:
        adv, _ = fn(token_level_rewards=R, response_mask=mask, config=cfg)
        # alpha = 0.5 from b = 0.5, v = 0.25: r=1 -> b = 0.75, v = 0.5*(0.25 + 0.5*0.25) = 0.1875;
        # r=0 -> d = -0.75, b = 0.375, v = 0.5*(0.1875 + 0.5*0.5625) = 0.234375
        std = 0.234375 ** 0.5
        expected = torch.tensor([[(1 - 0.375) / std] * 2 + [0.0], [(0 - 0.375) / std] * 3])
        torch.testing.assert_close(adv, expected)
        assert glue._ON_POLICY_STATS.count == 2  # the state persists across calls in the process
        with pytest.raises(ValueError, match="algorithm.claas_rpp_ema: unknown keys"):
            glue._ON_POLICY_STATS = None
            fn(token_level_rewards=R, response_mask=mask, config=OmegaConf.create({"claas_rpp_ema": {"bta": 0.5}}))
    finally:
        glue._ON_POLICY_STATS = None
