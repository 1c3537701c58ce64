"""Settings of the chat service (:class:`ServiceConfig`) and the exposure check of the address it listens on."""

from dataclasses import dataclass

from claas_verl.claas.service.guard import DEFAULT_TEMPLATE_KWARGS, LOOPBACK_HOSTS, bounded_int

REWARD_MODES = ("binary", "unit")


@dataclass(frozen=True)
class ServiceConfig:
    """Service settings.

    Fields:
        record: record turns at all (False: a plain proxy).
        default_scenario_id: scenario id of requests that give none; ``None`` makes such requests unrecordable.
        max_pending / pending_ttl_s: bound and timeout of the table of turns awaiting feedback (expiry and overflow
            drops are counted in the stats).
        grade_inline: with a grader, grade before answering (the response then carries the final status); by
            default grading runs after the response is sent, off the chat latency.
        sweep_interval_s: how often expired pending turns are dropped in the background.
        max_pending_per_key: pending turns one API key may hold (its oldest goes beyond); None: ``max_pending``.
        max_pending_bytes: byte budget of the whole pending table (token arrays, texts kept for a grader).
        max_grading: background gradings in flight; a chat beyond it is answered 429 before generating.
        rate_limit_per_s / rate_limit_burst: per-key token bucket over chat and feedback requests (429 with
            ``Retry-After``); None: no rate limit.
        max_buffer_share: the fraction of the replay buffer (of its capacity ``b_max``) one API key may hold when its
            next entry would push another key's entry out (see :mod:`~claas_verl.claas.service.buffer_share`); feedback
            beyond it is answered 429 with ``Retry-After`` and the turn stays pending. 1.0: no limit. The admin key
            is exempt.
        ack_timeout_s: how long a feedback waits for the replay buffer's acknowledgement (503 after).
        body_timeout_s: how long a request body may take to arrive in full (408 after: a trickling client).
        template_kwargs: the ``chat_template_kwargs`` keys a request may set (values: booleans, numbers, short
            strings); a request never supplies a template.
        api_keys: accepted ``Authorization: Bearer`` keys for every endpoint except ``/health`` / ``/ready``.
        allow_keyless: serve without API keys (explicit opt-in; loopback only, ``Host``/``Origin`` checked, see
            :func:`check_exposure`).
        admin_key: key of the admin endpoints (adapter load, shutdown); ``None`` disables them.
        adapter_root: the only directory ``POST /v1/claas/load_adapter`` loads from (a run's own output
            directory); ``None`` refuses every load over HTTP.
        reward: ``"binary"`` (rewards in {0, 1}) or ``"unit"`` (any value in [0, 1]); docs/math.md §A.1.4 rewards.
        max_body_bytes / max_messages / max_message_chars: request limits (413 / 400 / 400).
        max_tokens: the largest ``max_tokens`` a request may ask for (``None``: the backend's bound only);
            requests without ``max_tokens`` get ``default_max_tokens`` (or the backend's default).
    """

    record: bool = True
    default_scenario_id: int | None = 0
    max_pending: int = 4096
    pending_ttl_s: float = 600.0
    grade_inline: bool = False
    sweep_interval_s: float = 5.0
    max_pending_per_key: int | None = 1024
    max_pending_bytes: int = 256 << 20
    max_grading: int = 256
    rate_limit_per_s: float | None = None
    rate_limit_burst: int = 20
    max_buffer_share: float = 1.0
    ack_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    template_kwargs: tuple[str, ...] = DEFAULT_TEMPLATE_KWARGS
    api_keys: tuple[str, ...] = ()
    allow_keyless: bool = False
    admin_key: str | None = None
    adapter_root: str | None = None
    reward: str = "binary"
    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_message_chars: int = 32_768
    max_tokens: int | None = None
    default_max_tokens: int | None = None

    def __post_init__(self):
        if not self.api_keys and not self.allow_keyless:
            raise ValueError("no API keys: set api_keys (claas.service.api_keys or CLAAS_API_KEY), or opt in to a "
                             "keyless loopback service with allow_keyless=True")
        check_service_fields(self)


def check_service_fields(cfg: ServiceConfig, where: str = "") -> None:
    """Validate (and normalize to tuples) every :class:`ServiceConfig` field of ``cfg`` but the API-key requirement,
    which a job checks only once its keys are resolved. Errors name ``<where><field>`` (``where``: the YAML path of
    the section, e.g. ``"claas.service."``)."""
    def name(field_name: str) -> str:
        return f"{where}{field_name}"

    if cfg.default_scenario_id is not None:
        bounded_int(cfg.default_scenario_id, name("default_scenario_id"))
    if cfg.rate_limit_per_s is not None and not cfg.rate_limit_per_s > 0:
        raise ValueError(f"{name('rate_limit_per_s')} must be None or > 0, got {cfg.rate_limit_per_s}")
    share = cfg.max_buffer_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"{name('max_buffer_share')} must be a number in (0, 1]: the fraction of the replay buffer "
                         f"one API key may hold, 1 for no limit; got {share!r}")
    for field_name in ("max_pending_bytes", "max_grading", "rate_limit_burst",
                       "max_body_bytes", "max_messages", "max_message_chars"):
        value = getattr(cfg, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name(field_name)} must be an int >= 1, got {value!r}")
    for field_name in ("ack_timeout_s", "body_timeout_s", "sweep_interval_s"):
        if not getattr(cfg, field_name) > 0:
            raise ValueError(f"{name(field_name)} must be > 0, got {getattr(cfg, field_name)}")
    if cfg.reward not in REWARD_MODES:
        raise ValueError(f"{name('reward')} must be one of {REWARD_MODES}, got {cfg.reward!r}")
    keys = tuple(cfg.api_keys or ())
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError(f"{name('api_keys')} must be non-empty strings")
    if cfg.admin_key is not None and (not isinstance(cfg.admin_key, str) or not cfg.admin_key):
        raise ValueError(f"{name('admin_key')} must be a non-empty string or None")
    for field_name in ("max_tokens", "default_max_tokens"):
        value = getattr(cfg, field_name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name(field_name)} must be None or an int >= 1, got {value!r}")
    if cfg.max_tokens is not None and cfg.default_max_tokens is not None and cfg.default_max_tokens > cfg.max_tokens:
        raise ValueError(f"{name('default_max_tokens')}={cfg.default_max_tokens} exceeds "
                         f"{name('max_tokens')}={cfg.max_tokens}")
    # frozen dataclasses: normalize in place (YAML gives lists)
    object.__setattr__(cfg, "template_kwargs", tuple(cfg.template_kwargs or ()))
    object.__setattr__(cfg, "api_keys", keys)


def check_exposure(host: str, config: ServiceConfig) -> None:
    """Refuse to serve without API keys on anything but a loopback address (anyone could feed the trainer), and
    without keys unless keyless mode was opted in to."""
    if config.api_keys:
        return
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the chat service would listen on {host!r} without API keys; set claas.service.api_keys "
                         "(or the environment variable CLAAS_API_KEY), or listen on 127.0.0.1")
    if not config.allow_keyless:
        raise ValueError("the chat service has no API keys; set api_keys, or opt in to keyless loopback mode "
                         "(allow_keyless)")

