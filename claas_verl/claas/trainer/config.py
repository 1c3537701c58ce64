"""The ``claas:`` block of a CLaaS recipe, as a validated dataclass (no Ray, no verl).

Every field maps to one YAML key under ``claas``; unknown keys raise. Sizes follow docs/math.md §A.1.6/A.1.8
(``1 <= M <= B_min <= B_max``; the paper settings are M = 8, B_max = 1000, A_max 25/25/50).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from claas_verl.claas.service.config import ServiceConfig, check_service_fields

ALGORITHMS = ("reinforce_pp", "ppo", "sdpo", "icl", "no_update")


def _plain(value: Any) -> Any:
    """OmegaConf node -> plain Python (dict/list), anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return value


def _build(cls, raw: Any, where: str):
    raw = _plain(raw) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return cls(**raw)


@dataclass
class EnvConfig:
    """Scenario environment: ``name`` for ``claas_verl.claas.envs.make_environment`` plus its ``kwargs``."""

    name: str = "rule_following"
    kwargs: dict = field(default_factory=dict)


@dataclass
class StreamConfig:
    """K contiguous splits of a shuffled stream (docs/math.md §A.1.6; CLaaS paper §4: 100 scenarios, K = 5 splits of
    20).

    ``split_groups`` (not in the CLaaS paper): one scenario group per split (``scenario.meta[group_key]``, e.g. the rule
    families ``lowercase``), for a stream whose task changes from split to split (:class:`ScenarioStream`).
    """

    seed: int = 0
    num_splits: int = 5
    split_size: int | None = 20
    split_groups: list | None = None
    group_key: str = "families"

    def __post_init__(self):
        if not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"claas.stream.num_splits must be an int >= 1, got {self.num_splits!r}")
        if self.split_groups is not None:
            self.split_groups = [str(g) for g in self.split_groups]
            if len(self.split_groups) != self.num_splits:
                raise ValueError(f"claas.stream.split_groups has {len(self.split_groups)} entries but num_splits is "
                                 f"{self.num_splits}; give one group per split "
                                 "(or null for the CLaaS paper's shuffled splits)")
            if self.split_size is None:
                raise ValueError("claas.stream.split_groups needs claas.stream.split_size (scenarios per split)")


@dataclass
class ProducerConfig:
    """Rollout producers: how many scenarios run at once and the per-turn token budget."""

    max_concurrent_scenarios: int = 4
    max_new_tokens: int = 256
    enabled: bool = True  # false: no scenario stream; the chat API (claas.service) is the only source of entries
    max_retries: int = 2  # a failed/aborted generate or a failed grading call is retried this often, then dropped

    def __post_init__(self):
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"claas.producer.max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.max_concurrent_scenarios < 1:
            raise ValueError(
                f"claas.producer.max_concurrent_scenarios must be >= 1, got {self.max_concurrent_scenarios}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"claas.producer.max_new_tokens must be >= 1, got {self.max_new_tokens}")


JOB_SET_SERVICE_FIELDS = ("record", "default_scenario_id", "adapter_root", "default_max_tokens")
"""The :class:`ServiceConfig` fields a job fixes itself: it records every turn under scenario 0, loads no adapter over
HTTP (its own trainer publishes the versions), and answers requests without ``max_tokens`` with ``max_tokens``."""


@dataclass(frozen=True)
class ServiceSection(ServiceConfig):
    """``claas.service``: the chat API of the job (``claas_verl.claas.service``) in front of the job's own rollout
    servers. Every :class:`ServiceConfig` field is a key here (see its docstring; the fields in
    :data:`JOB_SET_SERVICE_FIELDS` must stay at their defaults), plus the keys of the job's HTTP server below.

    ``enabled``: serve ``/v1/chat/completions`` on ``host:port`` (port 0: a free port; the URL is written to
    ``<default_local_dir>/service.json``) under ``model_name``. ``api_keys`` (or ``$CLAAS_API_KEY``, comma separated)
    guard every endpoint but ``/health``; ``admin_key`` (or ``$CLAAS_ADMIN_KEY``; else a key minted for the run)
    guards ``/v1/claas/shutdown``. ``max_tokens``: the largest response a request may ask for (default
    ``claas.producer.max_new_tokens``, also the default budget). ``allow_keyless``: serve without keys (127.0.0.1
    only). Connections: ``limit_concurrency`` (503 beyond), ``header_timeout_s``; behind a TLS reverse proxy
    ``proxy_headers`` trusts ``X-Forwarded-*`` from ``forwarded_allow_ips``.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "claas"
    limit_concurrency: int = 512
    header_timeout_s: float = 10.0
    proxy_headers: bool = False
    forwarded_allow_ips: str = "127.0.0.1"

    def __post_init__(self):
        # no API-key requirement here: the keys may come from $CLAAS_API_KEY when the job starts (check_exposure)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"claas.service.port must be an int in [0, 65535], got {self.port!r}")
        if isinstance(self.limit_concurrency, bool) or not isinstance(self.limit_concurrency, int) \
                or self.limit_concurrency < 1:
            raise ValueError(f"claas.service.limit_concurrency must be an int >= 1, got {self.limit_concurrency!r}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"claas.service.header_timeout_s must be > 0, got {self.header_timeout_s}")
        defaults = {f.name: f.default for f in fields(ServiceConfig)}
        for name in JOB_SET_SERVICE_FIELDS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"claas.service.{name} is set by the job itself (see JOB_SET_SERVICE_FIELDS); "
                                 f"remove it from the recipe")
        check_service_fields(self, "claas.service.")

    def service_config(self, **job: Any) -> ServiceConfig:
        """The standalone :class:`ServiceConfig` of this section, with the values the job resolves at start
        (``job``: e.g. the API keys from the environment, the admin key, the token budget) replacing its own."""
        own = {f.name: getattr(self, f.name) for f in fields(ServiceConfig)}
        return ServiceConfig(**{**own, **job})


@dataclass
class EvalConfig:
    """Evaluation of each split checkpoint on every split (M[j, k], docs/math.md §A.4).

    ``temperature`` 1.0 evaluates the sampled policy (what the defender serves); 0 is greedy.
    ``n_samples`` rollouts per scenario; the cell is the mean pass rate over graded steps.
    """

    enabled: bool = True
    n_samples: int = 1
    temperature: float = 1.0
    max_new_tokens: int | None = None

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"claas.eval.n_samples must be >= 1, got {self.n_samples}")
        if self.temperature < 0:
            raise ValueError(f"claas.eval.temperature must be >= 0, got {self.temperature}")


@dataclass
class RppConfig:
    """EMA reward statistics of REINFORCE++ (docs/math.md §A.3.1 ``ema``)."""

    beta: float = 0.9
    b0: float = 0.5
    v0: float = 0.25
    v_min: float = 0.01


@dataclass
class IclConfig:
    """ICL baseline (CLaaS paper App. A.4): feedback log in the system prompt, FIFO at a token budget."""

    token_budget: int = 20_000
    max_quote_chars: int = 500


@dataclass
class SdpoConfig:
    """SDPO with an EMA teacher and a generalized JSD (docs/math.md §A.3.3); defaults are the math reference's."""

    mode: str = "gjs"                    # "gjs" (reference) | "pg+jsd"
    alpha: float = 0.5                   # GJS_α: 0 forward KL(T‖S), 1 reverse KL(S‖T), 0.5 JSD
    topk: int = 100                      # K: the student's top-K (+ one tail bucket)
    add_tail: bool = True
    is_clip: float = 2.0                 # w_e = min(ρ[e], is_clip)
    is_reference: str = "behaviour"      # "behaviour" | "ema_teacher" (ρ against the EMA teacher on x)
    ratio_mode: str = "geo_mean"         # A.2.2 sequence ratio of the IS weight
    tau: float = 0.05                    # EMA teacher update rate (teacher_update_rate)
    jsd_coef: float = 1.0                # λ_JSD of the pg+jsd mode
    reprompt_success: bool = False       # also reprompt passing steps (success template)

    def __post_init__(self):
        from claas_verl.losses.sdpo import IS_REFERENCES, SDPO_MODES

        if self.mode not in SDPO_MODES:
            raise ValueError(f"claas.sdpo.mode={self.mode!r}; choose one of {SDPO_MODES}")
        if self.is_reference not in IS_REFERENCES:
            raise ValueError(f"claas.sdpo.is_reference={self.is_reference!r}; choose one of {IS_REFERENCES}")
        if self.ratio_mode not in ("geo_mean", "product"):
            raise ValueError(f"claas.sdpo.ratio_mode={self.ratio_mode!r}; choose 'geo_mean' or 'product'")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"claas.sdpo.alpha={self.alpha} must be in [0, 1]")
        if self.topk < 1:
            raise ValueError(f"claas.sdpo.topk={self.topk} must be >= 1")
        if not self.is_clip > 0:
            raise ValueError(f"claas.sdpo.is_clip={self.is_clip} must be > 0")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"claas.sdpo.tau={self.tau} must be in [0, 1]")


@dataclass
class ClaasConfig:
    """Validated ``claas:`` recipe block.

    ``algorithm``: ``reinforce_pp`` | ``ppo`` | ``sdpo`` | ``icl`` | ``no_update``. ``icl`` never updates parameters
    (feedback goes into the system prompt); ``no_update`` is the plain baseline: the same producers and the same
    split evaluation, but nothing is inserted into the buffer, no optimizer step runs and no system-prompt memory
    is kept, so every row of M is the initial policy.
    ``m``/``b_min``/``b_max``/``a_max``: docs/math.md §A.1 sizes (counted in entries of ``entry_unit``). ``entry_unit``:
    ``"step"`` (docs/math.md §A.1.5 default) or ``"scenario"`` (one entry per scenario, trained as one multi-turn
    sequence with the scenario reward ``min_t r_t``; REINFORCE++ / PPO, producer-driven).
    ``max_updates``: optional cap on optimizer steps (None: the whole split protocol; then the LR schedule may not
    depend on the step count, see :func:`~claas_verl.claas.trainer.checks.check_schedule_without_step_count`).
    ``trace``: write ``claas_trace.jsonl`` (one line per update) next to the checkpoints.
    ``trace_served_weights``: a diagnostic for checking a cluster's weight sync, off in every recipe: after each
    weight push, every replica's served weights are copied to the trainer and fingerprinted (with its policy version
    and, on vLLM, its adapter-version state) into the trace, so each push can be seen to change what is served. It
    costs a full weight transfer per update.
    """

    algorithm: str = "reinforce_pp"
    m: int = 8
    b_min: int = 16
    b_max: int = 1000
    a_max: int = 25
    entry_unit: str = "step"
    seed: int = 0
    max_updates: int | None = None
    trace: bool = True
    trace_served_weights: bool = False
    env: EnvConfig = field(default_factory=EnvConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rpp: RppConfig = field(default_factory=RppConfig)
    icl: IclConfig = field(default_factory=IclConfig)
    sdpo: SdpoConfig = field(default_factory=SdpoConfig)
    service: ServiceSection = field(default_factory=ServiceSection)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"claas.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.entry_unit not in ("step", "scenario"):
            raise ValueError("claas.entry_unit must be 'step' or 'scenario' (docs/math.md §A.1.5), "
                             f"got {self.entry_unit!r}")
        if self.entry_unit == "scenario" and self.algorithm in ("sdpo", "icl"):
            raise ValueError(f"claas.entry_unit=scenario with claas.algorithm={self.algorithm}: SDPO and ICL work per "
                             "step (one feedback / teacher context per step); use entry_unit=step")
        if self.entry_unit == "scenario" and self.service.enabled:
            raise ValueError("claas.entry_unit=scenario with claas.service.enabled: the chat API records one entry per "
                             "turn; use entry_unit=step")
        if self.a_max < 0:
            raise ValueError(f"claas.a_max must be >= 0, got {self.a_max}")
        if self.max_updates is not None and self.max_updates < 1:
            raise ValueError(f"claas.max_updates must be null or >= 1, got {self.max_updates}")
        if not self.producer.enabled and not self.service.enabled:
            raise ValueError("claas.producer.enabled=false needs claas.service.enabled=true: with neither the "
                             "scenario producers nor the chat API nothing would ever reach the buffer")
        if self.service.enabled and self.algorithm == "no_update":
            raise ValueError("claas.service.enabled with claas.algorithm=no_update: the chat API's feedback would "
                             "never update anything; use reinforce_pp or ppo behind the API")
        if self.service.enabled and self.algorithm == "sdpo":
            raise ValueError("claas.service.enabled with claas.algorithm=sdpo: the chat API does not build SDPO's "
                             "re-prompted teacher context yet; use reinforce_pp or ppo behind the API")
        from claas_verl.claas.replay.buffer import validate_replay_sizes

        validate_replay_sizes(self.m, self.b_min, self.b_max)

    @property
    def trains(self) -> bool:
        """False for the ICL and no-update baselines (no parameter updates, nothing inserted into the buffer)."""
        return self.algorithm not in ("icl", "no_update")

    @classmethod
    def from_config(cls, raw: Any) -> ClaasConfig:
        raw = dict(_plain(raw) or {})
        subs = {"env": EnvConfig, "stream": StreamConfig, "producer": ProducerConfig, "eval": EvalConfig,
                "rpp": RppConfig, "icl": IclConfig, "sdpo": SdpoConfig, "service": ServiceSection}
        for key, sub_cls in subs.items():
            raw[key] = _build(sub_cls, raw.get(key), f"claas.{key}")
        return _build(cls, raw, "claas")
