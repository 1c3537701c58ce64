"""Replay entries -> the per-trajectory fields and tags verl's agent loop writes into TransferQueue.

verl's v1 trainer reads a sampled batch from TransferQueue by key; everything downstream (old log-prob,
advantages, actor/critic updates, metrics) expects the fields that ``AgentLoopWorkerTQ`` writes for one
trajectory. A replayed :class:`~claas_verl.claas.replay.ReplayEntry` is turned into exactly those fields, under
a fresh key per step (the trainer deletes a step's keys; the replay actor keeps the canonical entry).

Behaviour log-prob: only ℓb = Σ_j log π_β(y_j) is stored (docs/math.md §A.1.1), so ``rollout_log_probs`` holds ℓb
on the first response position and 0 elsewhere. With ``algorithm.rollout_correction.bypass_mode=True``
verl copies it to ``old_log_probs``; ``claas_seq_is`` uses only the masked per-sequence sum Σ_j m·old = ℓb,
so the per-sequence IS ratio is exact. Rewards go on the last response token (``rm_scores``), the verl
convention that ``claas_rpp_ema`` / GAE read. torch only; no verl, no Ray.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from claas_verl.claas.replay.entry import ReplayEntry, ScenarioEntry
from claas_verl.claas.service.teacher import TEACHER_IDS_KEY  # x' in entry metadata (producers and chat API fill it)

TEACHER_PROMPT_FIELD = "sdpo_teacher_prompt_ids"
HAS_FEEDBACK_FIELD = "sdpo_has_feedback"


def replay_key() -> str:
    """A fresh TransferQueue key in verl's ``{uid}_{session}_{index}`` shape (validation/dump code splits on ``_``)."""
    return f"{uuid.uuid4().hex}_0_0"


def entry_fields(entry: ReplayEntry, data_source: str = "claas", sdpo: bool = False) -> dict[str, Any]:
    """The agent-loop field dict of one replayed step entry.

    Shapes: ``prompts`` ``[Lp]``, ``responses``/``response_mask``/``loss_mask``/``rollout_log_probs``/``rm_scores``
    ``[n]`` with n = ``entry.n_tokens`` (every response token is a model token: m ≡ 1, docs/math.md §0),
    ``input_ids``/``position_ids`` ``[Lp + n]``. With ``sdpo``: ``sdpo_teacher_prompt_ids`` ``[Lp']`` (the
    teacher context x', docs/math.md §A.3.3) and the scalar ``sdpo_has_feedback``.
    """
    if isinstance(entry, ScenarioEntry):
        if sdpo:
            raise ValueError("SDPO trains on per-step entries (one teacher context per step); use entry_unit=step")
        return scenario_fields(entry, data_source)
    if not isinstance(entry, ReplayEntry):
        raise ValueError(f"entry_fields expects a ReplayEntry or a ScenarioEntry, got {type(entry).__name__}")
    prompts = torch.as_tensor(entry.prompt_ids.astype("int64"))
    responses = torch.as_tensor(entry.response_ids.astype("int64"))
    n = responses.numel()
    response_mask = torch.ones(n, dtype=torch.int64)
    behaviour = torch.zeros(n, dtype=torch.float32)
    behaviour[0] = float(entry.behaviour_logprob)  # Σ_j m·old = ℓb, which is all claas_seq_is reads
    rm_scores = torch.zeros(n, dtype=torch.float32)
    rm_scores[-1] = float(entry.reward)
    input_ids = torch.cat([prompts, responses])
    version = int(entry.P) if entry.P is not None else None
    teacher = entry.metadata.get(TEACHER_IDS_KEY) if entry.metadata else None
    sdpo_fields = {} if not sdpo else {
        # SDPO teacher context x' (docs/math.md §A.3.3) as a 1-D field per entry, and sd_mask (1 iff feedback exists).
        # Without feedback the student prompt stands in (never read: sd_mask = 0 drops the row).
        TEACHER_PROMPT_FIELD: torch.as_tensor(list(teacher), dtype=torch.int64) if teacher else prompts.clone(),
        HAS_FEEDBACK_FIELD: torch.tensor(1 if teacher else 0, dtype=torch.int64),
    }
    return {
        **sdpo_fields,
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "rollout_log_probs": behaviour,
        "rm_scores": rm_scores,
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.numel(), dtype=torch.int64),
        "num_turns": 2 * (int(entry.step_idx or 0) + 1) + 1,  # system + user/assistant pairs, as the agent loop counts
        "uid": entry.uid,
        "data_source": data_source,
        "extra_fields": {
            "global_steps": version,
            "min_global_steps": version,
            "max_global_steps": version,
            "policy_version": version,
            "scenario_id": int(entry.scenario_id),
            "step_idx": entry.step_idx,
            "feedback": entry.feedback,
        },
    }


def scenario_sequence(entry: ScenarioEntry) -> tuple[list[int], list[int], list[int], list[float]]:
    """``(prompt, response, mask, behaviour)`` of a scenario entry as ONE multi-turn sequence (docs/math.md §A.1.5 /
    A.3.1).

    The response part is ``y_0, o_1, y_1, ..., o_{T-1}, y_{T-1}``: each step's sampled tokens (mask 1) and the
    observation tokens between them (the next user turn and the chat template around it, mask 0), exactly as the
    rollout server saw them. That needs every step's prompt to extend the previous step's prompt + response token
    by token (the producer builds scenario prompts that way); otherwise the sequence would differ from what was
    sampled and the stored ℓ^b would not match, so ``ValueError`` names the step. ``behaviour`` holds each step's
    ℓ^b on its first sampled token and 0 elsewhere, so the masked sum is Σ_t ℓ^b_t (the scenario's sequence log-prob).
    """
    steps = entry.steps
    prompt = [int(t) for t in steps[0].prompt_ids]
    response: list[int] = []
    mask: list[int] = []
    behaviour: list[float] = []
    context = list(prompt)
    for t, step in enumerate(steps):
        p = [int(x) for x in step.prompt_ids]
        if p[: len(context)] != context:
            raise ValueError(
                f"scenario {entry.uid!r} steps[{t}].prompt_ids do not extend steps[{t - 1}]'s prompt + response: "
                "a per-scenario entry must be one token sequence (build multi-turn prompts by appending tokens)")
        obs = p[len(context):]
        y = [int(x) for x in step.response_ids]
        response += obs + y
        mask += [0] * len(obs) + [1] * len(y)
        behaviour += [0.0] * len(obs) + [float(step.behaviour_logprob)] + [0.0] * (len(y) - 1)
        context = p + y
    return prompt, response, mask, behaviour


def scenario_fields(entry: ScenarioEntry, data_source: str = "claas") -> dict[str, Any]:
    """The agent-loop field dict of one replayed per-scenario entry: the steps concatenated into one sequence with
    the observation tokens masked (``response_mask``/``loss_mask`` 0), the scenario reward ``r_i`` on the last token
    of the last step (docs/math.md §A.3.1 scenario mode) and the summed ℓ^b (see :func:`scenario_sequence`)."""
    if not isinstance(entry, ScenarioEntry):
        raise ValueError(f"scenario_fields expects a ScenarioEntry, got {type(entry).__name__}")
    prompt, response, mask, behaviour = scenario_sequence(entry)
    prompts = torch.tensor(prompt, dtype=torch.int64)
    responses = torch.tensor(response, dtype=torch.int64)
    response_mask = torch.tensor(mask, dtype=torch.int64)
    rm_scores = torch.zeros(len(response), dtype=torch.float32)
    rm_scores[-1] = float(entry.reward)  # the last step's last token ends the sequence (no observation after it)
    input_ids = torch.cat([prompts, responses])
    version = int(entry.P) if entry.P is not None else None
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "rollout_log_probs": torch.tensor(behaviour, dtype=torch.float32),
        "rm_scores": rm_scores,
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.numel(), dtype=torch.int64),
        "num_turns": 2 * len(entry.steps) + 1,
        "uid": entry.uid,
        "data_source": data_source,
        "extra_fields": {
            "global_steps": version, "min_global_steps": version, "max_global_steps": version,
            "policy_version": version, "scenario_id": int(entry.scenario_id), "step_idx": None,
            "feedback": entry.feedback,
        },
    }


def entry_tag(entry: ReplayEntry | ScenarioEntry) -> dict[str, Any]:
    """The TransferQueue tag of one replayed entry (``seq_len`` balances DP ranks; versions feed staleness metrics)."""
    if isinstance(entry, ScenarioEntry):
        prompt_len = int(entry.steps[0].prompt_ids.shape[0])
        response_len = int(entry.steps[-1].prompt_ids.shape[0]) + int(entry.steps[-1].n_tokens) - prompt_len
    else:
        prompt_len, response_len = int(entry.prompt_ids.shape[0]), int(entry.n_tokens)
    version = int(entry.P) if entry.P is not None else 0
    return {
        "status": "success",
        "prompt_len": prompt_len,
        "response_len": response_len,
        "seq_len": prompt_len + response_len,
        "global_steps": version,
        "min_global_steps": version,
        "max_global_steps": version,
    }
