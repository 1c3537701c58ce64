"""Did the update arrive? After every weight sync the rollout scores a fixed probe and the trainer compares.

The probe is a fixed token sequence ``s`` of ``K + 1`` tokens. For every prefix ``s[:j]`` (``j = 1..K``) each
rollout replica answers one greedy request for one token with its log-probability: ``g_j`` and
``served_j = log p_served(g_j | s[:j])``, the model's own log-softmax (no temperature at greedy). The trainer runs
one no-grad forward of the updated student on ``s`` and reads ``trained_j = log p_student(g_j | s[:j])`` at the
same tokens. Two metrics per step (``rollout/`` in the step's metrics and ``steps.jsonl``):

- ``rollout/weight_sync_max_abs_logprob_diff = max_{replica, j} |served_j - trained_j|``: kernel rounding only when
  the rollout serves the weights the trainer just produced (about 1e-5 in float32);
- ``rollout/weight_sync_max_abs_logprob_change = max_{replica, j} |served_j - served_j^prev|``: how far the served
  top-1 log-probabilities moved since the previous sync (``served_j`` is the maximum of the next-token log-softmax,
  a continuous function of the weights); 0 means the rollout still serves the previous weights.

Shared by both trainers: MOPD after every weight sync (``mopd.weight_sync_probe_tokens`` /
``mopd.weight_sync_max_abs_diff``) and CLaaS after every adapter push (``claas.weight_sync_probe_tokens`` /
``claas.weight_sync_max_abs_diff``; a multi-tenant job verifies each tenant's reload instead,
:mod:`claas_verl.claas.tenants.verify`). The trainer side of the comparison is :func:`engine_prefix_logprobs`,
run by each system's worker method.

The check acts (``<system>.weight_sync_max_abs_diff``, on by default): when ``max_{replica, j} |served_j - trained_j|``
or its mean exceeds the tolerance, a log line names both numbers and the job stops with
:class:`~claas_verl.metrics.served_check.ServedWeightsMismatch` (its message carries them too): training on while
the rollout samples from other weights than the trainer's would make every importance ratio wrong. ``null`` only
logs the metrics.
"""

from __future__ import annotations

import uuid

import ray

from claas_verl.metrics.served_check import ProbeTolerance, ServedCheckAlarm

DIFF_KEY = "rollout/weight_sync_max_abs_logprob_diff"
CHANGE_KEY = "rollout/weight_sync_max_abs_logprob_change"
PROBE_TEXT = "Continual learning keeps what it learned while it learns: one, two, three, four, five, six, seven."


def probe_ids(tokenizer, tokens: int, key: str = "mopd.weight_sync_probe_tokens") -> list[int]:
    """The fixed probe: the first ``tokens + 1`` token ids of :data:`PROBE_TEXT` under the student's tokenizer."""
    ids = [int(t) for t in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]][: tokens + 1]
    if len(ids) < 2:
        raise ValueError(f"{key}={tokens}: the probe needs at least 2 tokens, got {len(ids)}")
    return ids


def engine_prefix_logprobs(engine, ids: list[int], targets: list[list[int]]) -> list[list[float]]:
    """``log p(targets[r][j] | ids[:j+1])`` from one no-grad forward of ``ids`` through verl's engine (every rank
    runs it: FSDP gathers each layer across the ranks), under the engine's autocast as in its log-prob forward."""
    import torch

    from claas_verl.verl_ext.engine_device import compute_device, engine_autocast

    device = compute_device()
    with engine.eval_mode(), torch.no_grad(), engine_autocast(engine, device):
        logits = engine.module(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
    logp = torch.log_softmax(logits[0, : len(ids) - 1].float(), dim=-1).cpu()
    positions = torch.arange(len(ids) - 1)
    return [logp[positions, torch.tensor(t)].tolist() for t in targets]


def served_logprobs(replicas, ids: list[int]) -> list[tuple[list[int], list[float]]]:
    """Per replica: the greedy next token after every prefix of ``ids`` and its served log-probability."""
    out = []
    for replica in replicas:
        refs = [replica.server_handle.generate.remote(
                    prompt_ids=ids[:j], request_id=f"weight-sync-probe-{uuid.uuid4().hex}",
                    sampling_params={"temperature": 0.0, "max_tokens": 1, "logprobs": True})
                for j in range(1, len(ids))]
        answers = ray.get(refs)
        tokens = [int(a.token_ids[0]) for a in answers]
        logps = [float(a.log_probs[0]) for a in answers]
        out.append((tokens, logps))
    return out


def probe_metrics(served: list[tuple[list[int], list[float]]], trained: list[list[float]],
                  previous: list[list[float]] | None) -> dict[str, float]:
    """The two metrics of the module docstring; ``trained[r]`` holds the student's log-probs at replica ``r``'s
    tokens, ``previous[r]`` replica ``r``'s served log-probs at the previous sync (None: no change metric)."""
    diff = max(abs(s - t) for (_, logps), tr in zip(served, trained) for s, t in zip(logps, tr))
    metrics = {DIFF_KEY: diff}
    if previous is not None:
        metrics[CHANGE_KEY] = max(abs(s - p) for (_, logps), prev in zip(served, previous)
                                  for s, p in zip(logps, prev))
    return metrics


class WeightSyncProbe:
    """``<system>.weight_sync_probe_tokens`` long probe scored after every weight sync (0 turns it off); keeps the
    previous sync's served log-probs for the change metric; ``max_abs_diff`` (nats, None: log only) stops the job
    at the first sync whose served log-probs differ from the trainer's by more (max or mean over the probe).
    ``system``: ``mopd`` or ``claas``, the config section named in messages."""

    def __init__(self, tokens: int, max_abs_diff: float | None = None, system: str = "mopd"):
        self.key = f"{system}.weight_sync_probe_tokens"
        if tokens < 0:
            raise ValueError(f"{self.key}={tokens}: give the probe's length in tokens "
                             "(0 turns the weight-sync check off)")
        self.tokens = tokens
        self.previous: list[list[float]] | None = None
        self.alarm = None if max_abs_diff is None else ServedCheckAlarm(
            ProbeTolerance(max_abs=max_abs_diff, mean_abs=max_abs_diff), 1, f"{system} weight sync")

    def check(self, served: list[tuple[list[int], list[float]]], trained: list[list[float]]) -> None:
        """Stop the job (``ServedWeightsMismatch``) when the served probe log-probs are not the trained ones."""
        if self.alarm is not None:
            self.alarm.check("the rollout replicas", [logps for _, logps in served], trained)

    def measure(self, tokenizer, replicas, trained_logprobs) -> dict[str, float]:
        """Score the probe on every rollout replica and in the trainer's student: ``trained_logprobs(ids,
        targets)`` is the worker group's :func:`engine_prefix_logprobs` (rank 0's answer)."""
        ids = probe_ids(tokenizer, self.tokens, self.key)
        served = served_logprobs(replicas, ids)
        trained = trained_logprobs(ids, [tokens for tokens, _ in served])
        metrics = probe_metrics(served, trained, self.previous)
        self.previous = [logps for _, logps in served]
        self.check(served, trained)
        return metrics
