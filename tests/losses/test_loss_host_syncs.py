"""No host sync in a loss's hot path: every loss claas_verl registers with verl, and the math it calls, reads a
stated number of values on the host per call (claas_verl.utils.host_sync).

A host sync is any read of a tensor's value by Python (``bool(t)``, ``float(t)``, ``.item()``, ``.tolist()``),
boolean indexing (its output size needs ``nonzero``) or a copy to the CPU: on a GPU each one waits for every kernel
queued before it. :class:`HostSyncCounter` counts them on CPU tensors, at the two levels where they show:

- torch function level: ``Tensor.item/tolist/numpy/cpu``, ``__bool__/__float__/__int__/__index__`` and ``.to`` the
  CPU from another device (``tolist``, ``numpy`` and ``cpu`` never reach the dispatcher on CPU tensors);
- dispatch level, outside the calls above: ``aten._local_scalar_dense`` (what every scalar read of a tensor runs,
  also from C++), ``nonzero``, ``masked_select``, ``unique``, ``equal``, boolean ``index``/``index_put``, and
  copies to the CPU from another device.

The expected counts below are per call of the registered function (and 0 in its backward). The table must name
every policy loss claas_verl registers: a newly registered loss fails here until it states its count.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import claas_verl  # noqa: F401  (schedules the registrations for verl's core_algos import)
import claas_verl.claas.verl_losses as claas_losses
import claas_verl.mopd.verl_losses  # noqa: F401  (registers claas_topk_distill)
from claas_verl.distill import student_topk, topk_distill_loss_from_logprobs, topk_logprobs
from claas_verl.losses import EmaRewardStats, sdpo_loss, seq_is_clipped_loss
from claas_verl.utils.host_sync import ENV_VAR, debug_checks, debug_checks_enabled, metrics_to_floats

aten = torch.ops.aten
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__complex__"}
_SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
}


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = (name == "to" and this is not None and this.device.type != "cpu"
                   and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device")) if isinstance(a, str | torch.device)))
        if this is None or not (name in _HOST_READS or to_host):
            return func(*args, **kwargs)
        self.counter.record(f"Tensor.{name}")
        self.counter.depth += 1  # the dispatcher-level ops of this read are the same sync
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.depth -= 1


class _SyncOps(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.depth == 0 and self._syncs(func, args, kwargs):
            self.counter.record(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _syncs(func, args, kwargs) -> bool:
        if func in _SYNC_OPS:
            return True
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or [])
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0].device if func is aten.copy_.default else kwargs.get("device")
            return src.device.type != "cpu" and _is_cpu(dst)
        return False


class HostSyncCounter:
    """``with HostSyncCounter() as c: ...`` then ``c.count`` host syncs and ``c.events`` (what each one was)."""

    def __init__(self):
        self.events: list[str] = []
        self.depth = 0
        self._modes = (_HostReads(self), _SyncOps(self))

    @property
    def count(self) -> int:
        return len(self.events)

    def record(self, what: str) -> None:
        self.events.append(what)

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False


def _syncs(fn, *args, **kwargs):
    with HostSyncCounter() as counter:
        out = fn(*args, **kwargs)
    return counter, out


# --------------------------------------------------------------------------- the counter itself


def test_counter_sees_every_kind_of_host_read():
    x = torch.randn(4, 3)
    reads = [lambda: bool(x.sum() > 0), lambda: float(x.sum()), lambda: int(x.argmax()), lambda: x.max().item(),
             lambda: x.tolist(), lambda: x[x > 0], lambda: x.nonzero(), lambda: x.cpu(), lambda: torch.equal(x, x),
             lambda: x.numpy(), lambda: torch.unique(x), lambda: x.masked_select(x > 0)]
    for read in reads:
        counter, _ = _syncs(read)
        assert counter.count == 1, counter.events  # each once: a float() is not also counted as its item
    counter, _ = _syncs(lambda: (x * 2).sum(0).clamp(min=0).max())
    assert counter.count == 0, counter.events  # device-side ops stay on the device


def test_counter_sees_a_sync_inside_a_backward():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            if bool(g.isnan().any()):
                raise AssertionError("unreachable")
            return g * 2

    a = torch.randn(3, requires_grad=True)
    counter, _ = _syncs(lambda: ReadsInBackward.apply(a).sum().backward())
    assert counter.count == 1, counter.events


# --------------------------------------------------------------------------- inputs of realistic small shapes

B, T, K, V = 4, 16, 8, 64


def _mask() -> torch.Tensor:
    lengths = torch.tensor([16, 11, 5, 1])
    return torch.arange(T) < lengths[:, None]


def _actor_config():
    from verl.workers.config import ActorConfig

    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_torch_compile=False)
    mask = _mask()
    # what verl's ppo_loss puts there before each call: Python numbers, read once per mini-batch
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=int(mask.sum()) * 2, global_batch_size=2 * B,
                                 loss_scale_factor=None)
    return cfg


def _seq_is_inputs(g: torch.Generator) -> dict:
    log_prob = (torch.randn(B, T, generator=g) * 0.3 - 1).requires_grad_()
    return dict(
        old_log_prob=log_prob.detach() + torch.randn(B, T, generator=g) * 0.2,
        log_prob=log_prob,
        advantages=torch.randn(B, 1, generator=g).expand(B, T).contiguous(),
        response_mask=_mask(),
        loss_agg_mode="token-mean",
        config=_actor_config(),
        rollout_is_weights=torch.rand(B, T, generator=g) + 0.5,
    )


def _topk_inputs(g: torch.Generator) -> dict:
    return dict(
        old_log_prob=None,
        log_prob=torch.log_softmax(torch.randn(B, T, K, generator=g), -1).requires_grad_(),
        advantages=torch.randn(B, T, K, generator=g),
        response_mask=_mask(),
        loss_agg_mode="token-mean",
        config=OmegaConf.create({"ppo_epochs": 1, "global_batch_info": {"dp_size": 1, "batch_num_tokens": 33,
                                                                         "global_batch_size": B,
                                                                         "loss_scale_factor": None}}),
        rollout_is_weights=torch.rand(B, T, generator=g),
    )


# registered name -> (host syncs per call, why, its inputs)
ONE_METRICS_READ = ("the one read of its metrics dict (metrics_to_floats): verl 0.9.1's ppo_loss .item()s every "
                    "tensor metric it gets, so floats read in one transfer cost 1 where tensors would cost one per key")
EXPECTED_POLICY_LOSS_SYNCS = {
    "claas_seq_is": (1, ONE_METRICS_READ, _seq_is_inputs),
    "claas_seq_is_product": (1, ONE_METRICS_READ, _seq_is_inputs),
    "claas_topk_distill": (1, ONE_METRICS_READ, _topk_inputs),
}


def _registered_by_claas_verl(registry_name: str) -> list[str]:
    from verl.trainer.ppo import core_algos

    registry = getattr(core_algos, registry_name)
    return sorted(n for n, fn in registry.items() if getattr(fn, "__module__", "").startswith("claas_verl."))


def test_every_registered_policy_loss_states_its_sync_count():
    registered = _registered_by_claas_verl("POLICY_LOSS_REGISTRY")
    assert registered, "claas_verl registered no policy loss with verl"
    assert set(registered) == set(EXPECTED_POLICY_LOSS_SYNCS), (
        f"state the host syncs per call of every registered loss in EXPECTED_POLICY_LOSS_SYNCS: registered "
        f"{registered}, stated {sorted(EXPECTED_POLICY_LOSS_SYNCS)}"
    )


@pytest.mark.parametrize("name", sorted(EXPECTED_POLICY_LOSS_SYNCS))
def test_registered_policy_loss_makes_its_stated_syncs_and_none_in_backward(name, monkeypatch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    monkeypatch.delenv(ENV_VAR, raising=False)
    expected, why, inputs = EXPECTED_POLICY_LOSS_SYNCS[name]
    kwargs = inputs(torch.Generator().manual_seed(0))
    counter, (loss, metrics) = _syncs(get_policy_loss_fn(name), **kwargs)
    assert counter.count == expected, f"{name}: {counter.events} (stated {expected}: {why})"
    assert metrics and all(isinstance(v, float) for v in metrics.values())  # what verl's Metric takes without a read
    counter, _ = _syncs(loss.backward)
    assert counter.count == 0, counter.events
    assert kwargs["log_prob"].grad is not None and bool(torch.isfinite(kwargs["log_prob"].grad).all())


# --------------------------------------------------------------------------- the math behind them: none at all


def _assert_tensor_metrics(metrics: dict) -> None:
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key


@pytest.mark.parametrize("ratio_mode", ["geo_mean", "product"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_seq_is_clipped_loss_makes_no_sync(ratio_mode, loss_agg_mode, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    kw = _seq_is_inputs(torch.Generator().manual_seed(1))
    counter, (loss, metrics) = _syncs(
        seq_is_clipped_loss, kw["log_prob"], kw["old_log_prob"], kw["advantages"], kw["response_mask"],
        ratio_mode=ratio_mode, loss_agg_mode=loss_agg_mode, token_weights=kw["rollout_is_weights"],
        global_tokens=torch.tensor(66.0), global_seqs=8, dp_size=2,
    )
    assert counter.count == 0, counter.events
    _assert_tensor_metrics(metrics)


def test_seq_is_metrics_of_an_empty_mask_are_zero_without_a_sync(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    logp = torch.zeros(0, T, requires_grad=True)  # B = 0: the max over no sequence is 0, as before
    counter, (_, metrics) = _syncs(seq_is_clipped_loss, logp, logp.detach(), logp.detach(), torch.zeros(0, T))
    assert counter.count == 0, counter.events
    assert metrics_to_floats(metrics)["actor/seq_ratio_max"] == 0.0


@pytest.mark.parametrize("mode", ["gjs", "pg+jsd"])
def test_sdpo_loss_makes_no_sync(mode, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(2)
    mask = _mask()
    student = torch.log_softmax(torch.randn(B, T, V, generator=g), -1).requires_grad_()
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    ids = torch.randint(0, V, (B, T), generator=g)
    log_prob = student.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = log_prob.detach() + 0.1
    counter, (loss, metrics) = _syncs(
        sdpo_loss, student, teacher, log_prob, old, mask, torch.tensor([True, False, True, True]), mode=mode,
        topk=K, response_ids=ids, global_sd_tokens=40.0, global_tokens=50.0,
    )
    assert counter.count == 0, counter.events
    _assert_tensor_metrics(metrics)
    counter, _ = _syncs(loss.backward)
    assert counter.count == 0, counter.events


def test_topk_logprobs_and_loss_sync_only_in_the_overwrite_check_of_the_backward(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=g)
    ids, _ = student_topk(logits, K)
    z = logits.clone().requires_grad_()
    counter, loss = _syncs(lambda: topk_distill_loss_from_logprobs(
        topk_logprobs(z, ids, chunk_size=16), torch.randn(B, T, K, generator=g), _mask(), global_tokens=33))
    assert counter.count == 0, counter.events
    counter, _ = _syncs(loss.backward)
    # stated: _ChunkedTopkLogprobs.backward reads one flag, "were the logits overwritten since the forward?" (a
    # wrong gradient otherwise; see its docstring)
    assert counter.count == 1, counter.events


# --------------------------------------------------------------------------- the debug flag and the metrics read


def test_debug_flag_turns_the_value_checks_on(monkeypatch):
    kw = _seq_is_inputs(torch.Generator().manual_seed(4))
    adv = kw["advantages"].clone()
    adv[0, 0] = math.nan
    args = (kw["log_prob"], kw["old_log_prob"], adv, kw["response_mask"])
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not debug_checks_enabled()
    loss, _ = seq_is_clipped_loss(*args)
    assert math.isnan(loss.item())  # unchecked, the NaN reaches the loss (verl then skips the non-finite step)
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(ValueError, match="advantages holds 1 NaN/inf"):
        seq_is_clipped_loss(*args)
    counter, _ = _syncs(seq_is_clipped_loss, *(t.nan_to_num() for t in args))
    assert counter.count > 0  # the checks are host reads: that is why they sit behind the flag
    with debug_checks(False):  # the in-process switch overrides the environment
        assert not debug_checks_enabled()
        seq_is_clipped_loss(*args)
    assert debug_checks_enabled()


def test_metrics_to_floats_reads_once_and_equals_float_of_each():
    values = {"a": torch.tensor(0.1), "b": torch.tensor(1e-30, dtype=torch.float32), "c": torch.tensor(3),
              "d": torch.tensor(2.5, dtype=torch.bfloat16), "e": 7.0}
    counter, out = _syncs(metrics_to_floats, values)
    assert counter.count == 1, counter.events
    assert out == {k: float(v) for k, v in values.items()} and all(type(v) is float for v in out.values())
    assert metrics_to_floats({"x": 1.0}) == {"x": 1.0}
    with pytest.raises(ValueError, match="scalar"):
        metrics_to_floats({"x": torch.ones(2)})


# --------------------------------------------------------------------------- advantage estimators (once per step)

# registered name -> (host syncs per call, why); they run once per step on the driver, not per micro-batch
EXPECTED_ADV_EST_SYNCS = {
    "claas_rpp_ema": (1, "the finiteness check of the rewards (ema_advantages)"),
    "claas_rpp_global_whiten": (4, "the finiteness check, Σm, the valid returns and the all-equal edge case"),
}


def test_every_registered_advantage_estimator_states_its_sync_count():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    assert set(_registered_by_claas_verl("ADV_ESTIMATOR_REGISTRY")) == set(EXPECTED_ADV_EST_SYNCS)
    g = torch.Generator().manual_seed(5)
    mask = _mask().float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), mask.sum(-1).long() - 1] = torch.rand(B, generator=g)
    for name, (expected, why) in EXPECTED_ADV_EST_SYNCS.items():
        claas_losses.bind_rpp_ema_stats(EmaRewardStats())
        try:
            counter, _ = _syncs(get_adv_estimator_fn(name), rewards, mask, OmegaConf.create({"gamma": 1.0}))
        finally:
            claas_losses.bind_rpp_ema_stats(None)
        assert counter.count == expected, f"{name}: {counter.events} (stated {expected}: {why})"
