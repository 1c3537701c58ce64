"""The ``claas:`` block of a CLaaS recipe, as a validated dataclass (no Ray, no verl).

Every field maps to one YAML key under ``claas`` and carries its default and help text (:func:`knob`); unknown keys
raise. Sizes follow docs/math.md §A.1.6/A.1.8
(``1 <= M <= B_min <= B_max``; the paper settings are M = 8, B_max = 1000, A_max 25/25/50).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from claas_verl.claas.service.config import ServiceConfig, check_service_fields
from claas_verl.utils.schema import knob

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
    """``claas.env``: the scenario environment."""

    name: str = knob("rule_following", "environment name for claas_verl.claas.envs.make_environment")
    kwargs: dict = knob(help="keyword arguments of the environment (rule_following: num_scenarios, seed, num_turns, "
                        "max_rules)", factory=dict)


@dataclass
class StreamConfig:
    """``claas.stream``: K contiguous splits of a shuffled stream (docs/math.md §A.1.6; CLaaS paper §4: 100
    scenarios, K = 5 splits of 20), or one scenario group per split (:class:`ScenarioStream`)."""

    seed: int = knob(0, "seed of the scenario shuffle")
    num_splits: int = knob(5, "K, the number of splits (the CLaaS paper: 5)")
    split_size: int | None = knob(20, "scenarios per split (null: the scenarios divided evenly over the splits)")
    split_groups: list | None = knob(None, "not in the CLaaS paper: one scenario group per split "
                                     "(scenario.meta[group_key], e.g. [lowercase, capital_start, ...]), a stream "
                                     "whose task changes from split to split; null: the paper's shuffled splits")
    group_key: str = knob("families", "the scenario meta key that split_groups names")

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
    """``claas.producer``: the rollout producers."""

    max_concurrent_scenarios: int = knob(16, "scenarios the producers run at once")
    max_new_tokens: int = knob(1024, "token budget of one reply (also the rollout's response_length)")
    enabled: bool = knob(True, "false: no scenario stream; the chat API (claas.service) is the only source of "
                         "entries")
    max_retries: int = knob(2, "a failed or aborted generate or grading call is retried this often, then dropped")

    def __post_init__(self):
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"claas.producer.max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.max_concurrent_scenarios < 1:
            raise ValueError(
                f"claas.producer.max_concurrent_scenarios must be >= 1, got {self.max_concurrent_scenarios}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"claas.producer.max_new_tokens must be >= 1, got {self.max_new_tokens}")


TENANT_ALGORITHMS = ("reinforce_pp", "sdpo")
"""Algorithms a multi-tenant job trains (each tenant: its adapter, AdamW state, schedule, EMA statistics, SDPO EMA
teacher); PPO would need a critic per tenant."""

JOB_SET_SERVICE_FIELDS = ("record", "default_scenario_id", "adapter_root", "default_max_tokens")
"""The :class:`ServiceConfig` fields a job fixes itself: it records every turn under scenario 0, loads no adapter over
HTTP (its own trainer publishes the versions), and answers requests without ``max_tokens`` with ``max_tokens``."""


@dataclass(frozen=True)
class ServiceSection(ServiceConfig):
    """``claas.service``: the chat API of the job (``claas_verl.claas.service``) in front of the job's own rollout
    servers. Every :class:`ServiceConfig` field is a key here but those in :data:`JOB_SET_SERVICE_FIELDS` (they must
    stay at their defaults), plus the keys of the job's HTTP server below."""

    enabled: bool = knob(False, "serve /v1/chat/completions on host:port in front of the job's rollout servers")
    host: str = knob("127.0.0.1", "address the chat API listens on (anything but loopback needs api_keys)")
    port: int = knob(8000, "port of the chat API (0: a free port; the URL is written to "
                     "<default_local_dir>/service.json)")
    model_name: str = knob("claas", "model name the chat API serves under")
    limit_concurrency: int = knob(512, "connections and requests beyond it are answered 503 at once")
    header_timeout_s: float = knob(10.0, "request headers must be complete within it (else the connection closes)")
    proxy_headers: bool = knob(False, "behind a TLS reverse proxy: trust X-Forwarded-* from forwarded_allow_ips")
    forwarded_allow_ips: str = knob("127.0.0.1", "addresses whose X-Forwarded-* headers are trusted")
    max_loaded_adapters: int = knob(4, "with tenants: adapters the serving engine holds at once (a tenant beyond "
                                    "them is reloaded from its file on its next request)")
    tenant_engine_url: str | None = knob(None, "with tenants: a vLLM OpenAI server (http://host:port, started with "
                                         "--enable-lora, --max-cpu-loras >= max_loaded_adapters, the run directory "
                                         "readable) that serves the tenants' adapters; null: the chat API's own "
                                         "transformers engine in the driver (CPU)")
    tenant_engine_model: str | None = knob(None, "with tenant_engine_url: the name that server serves the base "
                                           "model under (null: actor_rollout_ref.model.path)")
    probe_tokens: int = knob(8, "with tenants: tokens of the fixed probe scored by the serving engine and the "
                             "trainer after each reload (docs/service.md, verified serving)")
    max_probe_failures: int = knob(3, "with tenants: probe mismatches (all tenants together) before the job stops; "
                                   "each mismatch keeps the tenant on its previous version")

    @property
    def tenant_names(self) -> tuple[str, ...]:
        """The configured tenants (empty: one implicit tenant, the single-adapter job)."""
        return () if self.directory.implicit else tuple(self.directory.names)

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
        for name in ("max_loaded_adapters", "probe_tokens", "max_probe_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"claas.service.{name} must be an int >= 1, got {value!r}")

    def service_config(self, **job: Any) -> ServiceConfig:
        """The standalone :class:`ServiceConfig` of this section, with the values the job resolves at start
        (``job``: e.g. the API keys from the environment, the admin key, the token budget) replacing its own."""
        own = {f.name: getattr(self, f.name) for f in fields(ServiceConfig)}
        return ServiceConfig(**{**own, **job})


@dataclass
class EvalConfig:
    """``claas.eval``: evaluation of each split checkpoint on every split (M[j, k], docs/math.md §A.4)."""

    enabled: bool = knob(True, "evaluate every split checkpoint on every split (the matrix M)")
    n_samples: int = knob(1, "rollouts per scenario; a cell of M is the mean pass rate over graded steps")
    temperature: float = knob(1.0, "sampling temperature of the evaluation (1.0: the sampled policy the defender "
                              "serves; 0: greedy)")
    max_new_tokens: int | None = knob(None, "token budget of one evaluation reply "
                                      "(null: claas.producer.max_new_tokens)")

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"claas.eval.n_samples must be >= 1, got {self.n_samples}")
        if self.temperature < 0:
            raise ValueError(f"claas.eval.temperature must be >= 0, got {self.temperature}")


@dataclass
class RppConfig:
    """``claas.rpp``: EMA reward statistics of REINFORCE++ (docs/math.md §A.3.1 ``ema``)."""

    beta: float = knob(0.9, "EMA decay of the reward mean and variance")
    b0: float = knob(0.5, "initial EMA reward mean (the baseline)")
    v0: float = knob(0.25, "initial EMA reward variance")
    v_min: float = knob(0.01, "floor of the variance the advantage is divided by")


@dataclass
class IclConfig:
    """``claas.icl``: the ICL baseline (CLaaS paper App. A.4): a feedback log in the system prompt."""

    token_budget: int = knob(20_000, "token budget of the feedback log (FIFO beyond it)")
    max_quote_chars: int = knob(500, "characters of a reply quoted in the log")


@dataclass
class SdpoConfig:
    """``claas.sdpo``: SDPO with an EMA teacher and a generalized JSD (docs/math.md §A.3.3)."""

    mode: str = knob("gjs", "gjs (the reference) | pg+jsd")
    alpha: float = knob(0.5, "α of GJS_α: 0 forward KL(T‖S), 1 reverse KL(S‖T), 0.5 JSD")
    topk: int = knob(100, "K: the student's top-K tokens (plus one tail bucket)")
    add_tail: bool = knob(True, "add the tail bucket (the mass outside the top K)")
    is_clip: float = knob(2.0, "the IS weight is min(ρ, is_clip)")
    is_reference: str = knob("behaviour", "the IS ratio's denominator: behaviour | ema_teacher (the EMA teacher on "
                             "the prompt)")
    ratio_mode: str = knob("geo_mean", "sequence ratio of the IS weight (docs/math.md §A.2.2): geo_mean | product")
    tau: float = knob(0.05, "EMA teacher update rate")
    jsd_coef: float = knob(1.0, "λ_JSD of the pg+jsd mode")
    reprompt_success: bool = knob(False, "also re-prompt passing steps (success template)")

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
    """Validated ``claas:`` recipe block: the one home of every ``claas.*`` default and its help text
    (docs/config.md lists them; ``recipes/claas/common/base.yaml`` repeats the defaults, held equal by
    ``tests/claas/trainer/test_claas_schema_yaml.py``). Built once per run (:meth:`from_config`), which validates
    every value; the code below trusts it.

    ``icl`` never updates parameters (feedback goes into the system prompt); ``no_update`` is the plain baseline:
    the same producers and split evaluation, but nothing enters the buffer, no optimizer step runs and no
    system-prompt memory is kept, so every row of M is the initial policy. With ``max_updates`` set the LR schedule
    may not depend on the step count (:func:`~claas_verl.claas.trainer.checks.check_schedule_without_step_count`).
    ``trace_served_weights`` (off in every recipe) copies every replica's served weights to the trainer after each
    push and fingerprints them (with the policy version and, on vLLM, the adapter-version state) into the trace.
    """

    algorithm: str = knob("reinforce_pp", "reinforce_pp | ppo | sdpo | icl | no_update (the last two never update "
                          "parameters)")
    m: int = knob(8, "M, entries per update (docs/math.md §A.1; the CLaaS paper: 8)")
    # the CLaaS paper's Chinese rendering's 100 is infeasible with 20 scenarios x <= 4 steps per split (§A.1.8)
    b_min: int = knob(32, "B_min, the buffer trains only while it holds at least this many entries (M <= B_min)")
    b_max: int = knob(1000, "B_max, the buffer's capacity; the oldest entry goes beyond it (B_min <= B_max)")
    a_max: int = knob(25, "A_max, the largest age (updates since it was produced) an entry may reach and still be "
                      "kept")
    entry_unit: str = knob("step", "step (one entry per graded step, docs/math.md §A.1.5) | scenario (one multi-turn "
                           "entry per scenario with reward min_t r_t; REINFORCE++ / PPO)")
    seed: int = knob(0, "seed of the buffer's sampling")
    max_updates: int | None = knob(None, "cap on optimizer steps (null: the whole split protocol; the LR schedule "
                                   "may then not depend on the step count)")
    trace: bool = knob(True, "write claas_trace.jsonl (one line per update) next to the checkpoints")
    trace_served_weights: bool = knob(False, "diagnostic, a full weight transfer per update: after each push, "
                                      "fingerprint every replica's served weights into the trace")
    weight_sync_probe_tokens: int = knob(8, "after every adapter push the rollout replicas and the trainer score a "
                                         "fixed probe of this many tokens (claas_verl/verl_ext/weight_probe.py); 0: "
                                         "off. A tenants job verifies each tenant's reload instead")
    weight_sync_max_abs_diff: float | None = knob(0.5, "the job stops (ServedWeightsMismatch) when a replica's probe "
                                                  "log-probs differ from the trainer's by more (nats, max or mean); "
                                                  "null: only logged")
    env: EnvConfig = knob(help="the scenario environment", factory=EnvConfig)
    stream: StreamConfig = knob(help="the split stream", factory=StreamConfig)
    producer: ProducerConfig = knob(help="the rollout producers", factory=ProducerConfig)
    eval: EvalConfig = knob(help="the split evaluation", factory=EvalConfig)
    rpp: RppConfig = knob(help="REINFORCE++'s EMA statistics", factory=RppConfig)
    icl: IclConfig = knob(help="the ICL baseline", factory=IclConfig)
    sdpo: SdpoConfig = knob(help="SDPO", factory=SdpoConfig)
    service: ServiceSection = knob(help="the chat API", factory=ServiceSection)

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
        if isinstance(self.weight_sync_probe_tokens, bool) or self.weight_sync_probe_tokens < 0:
            raise ValueError(f"claas.weight_sync_probe_tokens must be an int >= 0 (0 turns the check off), got "
                             f"{self.weight_sync_probe_tokens!r}")
        tol = self.weight_sync_max_abs_diff
        if tol is not None and (isinstance(tol, bool) or not 0 < float(tol) < float("inf")):
            raise ValueError(f"claas.weight_sync_max_abs_diff={tol!r}: give the largest accepted served-vs-trained "
                             "log-prob difference in nats (> 0), or null to only log it")
        if self.max_updates is not None and self.max_updates < 1:
            raise ValueError(f"claas.max_updates must be null or >= 1, got {self.max_updates}")
        if not self.producer.enabled and not self.service.enabled:
            raise ValueError("claas.producer.enabled=false needs claas.service.enabled=true: with neither the "
                             "scenario producers nor the chat API nothing would ever reach the buffer")
        if self.service.tenant_names and (self.producer.enabled or not self.service.enabled):
            raise ValueError("claas.service.tenants trains one adapter per tenant from the chat API's feedback: set "
                             "claas.service.enabled=true and claas.producer.enabled=false (the scenario producers "
                             "belong to no tenant)")
        if self.service.tenant_names and self.algorithm not in TENANT_ALGORITHMS:
            raise ValueError(f"claas.service.tenants with claas.algorithm={self.algorithm}: per-tenant updates run "
                             f"{' or '.join(TENANT_ALGORITHMS)} (a per-tenant PPO critic is not built); choose one "
                             "of them or remove claas.service.tenants")
        if self.service.enabled and self.algorithm == "no_update":
            raise ValueError("claas.service.enabled with claas.algorithm=no_update: the chat API's feedback would "
                             "never update anything; use reinforce_pp, ppo or sdpo behind the API")
        from claas_verl.claas.replay.buffer import validate_replay_sizes

        validate_replay_sizes(self.m, self.b_min, self.b_max)
        for name in self.service.tenant_names:  # each tenant's update draws claas.m entries of its own partition
            t = self.service.directory[name]
            try:
                validate_replay_sizes(self.m, t.b_min, t.b_max)
            except ValueError as exc:
                raise ValueError(f"claas.service.tenants.{name}: {exc} (claas.m={self.m} entries per update)") from None

    def unreachable_b_min(self, entries_per_split: int) -> str | None:
        """A warning when ``b_min`` exceeds the entries one split can produce (docs/math.md §A.1.8: with ``B_min=100``
        and 20 scenarios x <= 4 steps, training never starts within a split), else None. The sizes themselves were
        checked when the config was built."""
        if self.b_min <= entries_per_split:
            return None
        return (f"claas.b_min = {self.b_min} exceeds the {entries_per_split} entries one split can produce: training "
                "will not start within a split and 'train until |B| < b_min' is vacuous (docs/math.md §A.1.8); lower "
                "claas.b_min")

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
