"""Driver side of the per-step log (``mopd.probe``; worker side :mod:`claas_verl.mopd.trainer.fixed_probe`).

With ``mopd.probe.enabled``, every stage holds M_{k−1} (``student:<k−1>``; M_0 = π0) beside its teachers
(:meth:`probe_reference`); at the stage's start :meth:`StepProbe.begin_stage` samples the probe from it (the first
``prompts`` held-out prompts of every domain learned by the end of the stage, the stage's own included, ×
``responses_per_prompt``, seed ``seed``) and keeps it in the workers; around every update :meth:`before_update` /
:meth:`after_update` add ``mopd/probe_kl/<domain>`` (token mean of the exact KL(student ‖ M_{k−1})) and
``mopd/update_norm`` to the step's metrics, which ``steps.jsonl`` keeps. A run resumed mid-stage samples the same
probe again (same reference weights, same seed).
"""

from __future__ import annotations

from claas_verl.mopd.config import ProbeConfig
from claas_verl.mopd.trainer.plan_steps import learned_domains


def probe_reference(stage: int) -> str:
    """The plan name of M_{k−1} for stage ``stage`` (``student:0`` is π0)."""
    return f"student:{stage - 1}"


def probe_prompt_ids(dataset, rows: int, tokenizer) -> list[list[int]]:
    """Token ids of the first ``rows`` held-out prompts, chat template applied with the generation prompt."""
    out = []
    for i in range(min(rows, len(dataset))):
        text = tokenizer.apply_chat_template(list(dataset[i]["raw_prompt"]), add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def token_means(sums: dict[str, tuple[float, int]]) -> dict[str, float]:
    """``{"mopd/probe_kl/<domain>": Σ KL / tokens}`` from the worker's per-domain sums."""
    out = {}
    for domain, (total, tokens) in sums.items():
        if tokens < 1:
            raise ValueError(f"the probe of domain {domain!r} has no reply token")
        out[f"mopd/probe_kl/{domain}"] = total / tokens
    return out


class StepProbe:
    """The stage's probe state on the driver: which stage's probe the workers hold."""

    def __init__(self, settings: ProbeConfig, plan_steps: list[dict], bounds: dict[int, tuple[int, int]],
                 max_response_tokens: int):
        self.settings = settings
        self.plan_steps, self.bounds = plan_steps, bounds
        self.max_tokens = max_response_tokens
        self.stage: int | None = None
        self.datasets: dict = {}  # domain -> held-out dataset (the forgetting evaluation's)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def domains(self, stage: int) -> list[str]:
        """Every domain learned by the end of ``stage`` that has held-out prompts."""
        return [d for d in learned_domains(self.plan_steps, self.bounds[stage][1]) if d in self.datasets]

    def begin_stage(self, wg, stage: int, tokenizer) -> None:
        if not self.enabled or self.stage == stage:
            return
        domains = self.domains(stage)
        if not domains:
            raise ValueError("mopd.probe.enabled=true but no learned domain has held-out prompts: set "
                             "mopd.domains.<d>.test_prompts")
        prompts = {d: probe_prompt_ids(self.datasets[d], self.settings.prompts, tokenizer) for d in domains}
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        tokens = wg.mopd_probe_begin(probe_reference(stage), prompts, self.settings.responses_per_prompt,
                                     self.settings.seed, self.max_tokens, eos)[0]
        print(f"[mopd] stage {stage} probe: {self.settings.prompts} prompts x {self.settings.responses_per_prompt} "
              f"replies from {probe_reference(stage)} per domain, reply tokens {tokens}")
        self.stage = stage

    def before_update(self, wg) -> None:
        if self.enabled:
            wg.mopd_params_snapshot()

    def after_update(self, wg, metrics: dict) -> None:
        if not self.enabled:
            return
        metrics["mopd/update_norm"] = float(wg.mopd_update_norm()[0])
        metrics.update(token_means(wg.mopd_probe_kl()[0]))
