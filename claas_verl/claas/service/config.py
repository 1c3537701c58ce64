"""Settings of the chat service (:class:`ServiceConfig`) and the exposure check of the address it listens on."""

from dataclasses import dataclass
from typing import Any

from claas_verl.claas.service.guard import DEFAULT_TEMPLATE_KWARGS, LOOPBACK_HOSTS, bounded_int
from claas_verl.claas.tenants.config import TenantDirectory
from claas_verl.utils.schema import knob

REWARD_MODES = ("binary", "unit")


@dataclass(frozen=True)
class ServiceConfig:
    """Settings of the chat service; each field's help text is in its ``metadata`` (docs/config.md lists them)."""

    record: bool = knob(True, "record turns at all (false: a plain proxy)")
    default_scenario_id: int | None = knob(0, "scenario id of requests that give none; null makes such requests "
                                           "unrecordable")
    max_pending: int = knob(4096, "turns awaiting feedback that are kept (overflow drops are counted in the stats)")
    pending_ttl_s: float = knob(600.0, "seconds a turn waits for feedback before it is dropped (counted)")
    grade_inline: bool = knob(False, "with a grader, grade before answering (the response carries the final "
                              "status); by default grading runs after the response is sent, off the chat latency")
    sweep_interval_s: float = knob(5.0, "how often expired pending turns are dropped in the background")
    max_pending_per_key: int | None = knob(1024, "pending turns one API key may hold (its oldest goes beyond); "
                                           "null: max_pending")
    max_pending_bytes: int = knob(256 << 20, "byte budget of the whole pending table (token arrays, texts kept for "
                                  "a grader)")
    max_grading: int = knob(256, "background gradings in flight; a chat beyond it is answered 429 before "
                            "generating")
    rate_limit_per_s: float | None = knob(None, "per-key token bucket over chat and feedback requests, requests/s "
                                          "(429 with Retry-After beyond); null: no rate limit")
    rate_limit_burst: int = knob(20, "burst size of the per-key token bucket")
    max_buffer_share: float = knob(1.0, "fraction of the replay buffer (of b_max) one API key may hold when its "
                                   "next entry would push another key's out; feedback beyond it is answered 429 and "
                                   "the turn stays pending; 1.0: no limit; the admin key is exempt")
    ack_timeout_s: float = knob(30.0, "how long a feedback waits for the replay buffer's acknowledgement (503 after)")
    body_timeout_s: float = knob(30.0, "how long a request body may take to arrive in full (408 after)")
    template_kwargs: tuple[str, ...] = knob(DEFAULT_TEMPLATE_KWARGS, "the chat_template_kwargs keys a request may "
                                            "set (values: booleans, numbers, short strings); a request never "
                                            "supplies a template")
    api_keys: tuple[str, ...] = knob((), "accepted 'Authorization: Bearer' keys for every endpoint but /health and "
                                     "/ready (in a job also $CLAAS_API_KEY, comma separated)")
    allow_keyless: bool = knob(False, "serve without API keys: an explicit opt-in, loopback only, Host/Origin "
                               "checked")
    admin_key: str | None = knob(None, "key of the admin endpoints (adapter load, shutdown); null disables them "
                                 "(in a job: $CLAAS_ADMIN_KEY, else a key minted for the run)")
    adapter_root: str | None = knob(None, "the only directory POST /v1/claas/load_adapter loads from; null refuses "
                                    "every load over HTTP")
    reward: str = knob("binary", "binary (rewards in {0, 1}) or unit (any value in [0, 1]); docs/math.md §A.1.4")
    max_body_bytes: int = knob(1 << 20, "largest request body (413 beyond)")
    max_messages: int = knob(256, "most messages in one request (400 beyond)")
    max_message_chars: int = knob(32_768, "longest message of a request (400 beyond)")
    max_tokens: int | None = knob(None, "the largest max_tokens a request may ask for (null: the backend's bound; "
                                  "in a job: claas.producer.max_new_tokens)")
    default_max_tokens: int | None = knob(None, "max_tokens of a request that gives none (null: the backend's "
                                          "default)")
    tenants: dict[str, Any] | None = knob(None, "tenants: name -> {api_keys, b_min, b_max, a_max, max_pending, "
                                          "rate_limit_per_s, rate_limit_burst, max_buffer_share} (rows "
                                          "claas.service.tenants.<t>.*); each tenant's keys see only its own turns, "
                                          "buffer partition and adapter; with tenants, api_keys must be empty (every "
                                          "key names its tenant); null: one implicit tenant 'default' holds every "
                                          "key")

    @property
    def directory(self) -> TenantDirectory:
        """The :class:`~claas_verl.claas.tenants.config.TenantDirectory` of ``tenants`` (built by
        :func:`check_service_fields`; implicit when no tenants are configured)."""
        found = self.__dict__.get("_directory")
        if found is None:
            found = TenantDirectory(self.tenants)
            object.__setattr__(self, "_directory", found)
        return found

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """Every key the chat endpoints accept: ``api_keys``, or with tenants every tenant's keys."""
        return tuple(self.api_keys or ()) + self.directory.api_keys()

    def __post_init__(self):
        if not self.accepted_keys and not self.allow_keyless:
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
    object.__setattr__(cfg, "_directory", check_tenants(cfg, where))


def check_tenants(cfg: ServiceConfig, where: str = "") -> TenantDirectory:
    """The tenant directory of ``cfg.tenants``; ``ValueError`` naming ``<where>tenants.<t>.<field>``.

    The key rule: with tenants, every key belongs to exactly one tenant, so ``api_keys`` must be empty (a key listed
    there as well as under a tenant is named as such), and the admin key is no tenant's key (it sees every tenant,
    and chats or gives feedback as none)."""
    tenants = cfg.tenants
    if tenants is not None and not isinstance(tenants, dict):
        try:  # an OmegaConf node from a recipe
            from omegaconf import DictConfig, OmegaConf

            if isinstance(tenants, DictConfig):
                tenants = OmegaConf.to_container(tenants, resolve=True)
                object.__setattr__(cfg, "tenants", tenants)
        except ImportError:  # pragma: no cover - omegaconf ships with the project
            pass
    directory = TenantDirectory(tenants or None, where=f"{where}tenants.")
    if directory.implicit:
        return directory
    both = [k for k in cfg.api_keys if directory.tenant_of(k) is not None]
    if both:
        raise ValueError(f"{where}api_keys: {len(both)} key(s) also listed under {where}tenants.<t>.api_keys (the "
                         "keys are not shown); with tenants every key belongs to exactly one tenant: list it under "
                         "its tenant only")
    if cfg.api_keys:
        raise ValueError(f"{where}api_keys must be empty when {where}tenants is set: a key outside every tenant "
                         f"would have no adapter, buffer or quota; list each key under its tenant's api_keys")
    if cfg.admin_key is not None and directory.tenant_of(cfg.admin_key) is not None:
        raise ValueError(f"{where}admin_key is also a key of tenant {directory.tenant_of(cfg.admin_key)!r}; the "
                         "admin key must belong to no tenant")
    if cfg.allow_keyless:
        raise ValueError(f"{where}allow_keyless cannot be combined with {where}tenants: a tenant is a set of keys")
    if cfg.max_buffer_share != 1.0:
        raise ValueError(f"{where}max_buffer_share applies to the one shared buffer; with {where}tenants each tenant "
                         f"has its own partition: set {where}tenants.<t>.max_buffer_share instead")
    return directory


def check_exposure(host: str, config: ServiceConfig) -> None:
    """Refuse to serve without API keys on anything but a loopback address (anyone could feed the trainer), and
    without keys unless keyless mode was opted in to."""
    if config.accepted_keys:
        return
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the chat service would listen on {host!r} without API keys; set claas.service.api_keys "
                         "(or the environment variable CLAAS_API_KEY), or listen on 127.0.0.1")
    if not config.allow_keyless:
        raise ValueError("the chat service has no API keys; set api_keys, or opt in to keyless loopback mode "
                         "(allow_keyless)")

