"""``claas.service`` is the standalone service's :class:`ServiceConfig` plus the job's server keys: every service
setting is a recipe key, reaches the running service unchanged, and a bad value names its YAML key."""

from dataclasses import fields

import pytest

from claas_verl.claas.service import ServiceConfig
from claas_verl.claas.trainer.config import JOB_SET_SERVICE_FIELDS, ClaasConfig

# one non-default, valid value per ServiceConfig field a recipe may set
NON_DEFAULTS = {
    "max_pending": 7, "pending_ttl_s": 9.5, "grade_inline": True, "sweep_interval_s": 0.5,
    "max_pending_per_key": 3, "max_pending_bytes": 1 << 20, "max_grading": 2, "rate_limit_per_s": 4.0,
    "rate_limit_burst": 5, "max_buffer_share": 0.25, "ack_timeout_s": 3.0, "body_timeout_s": 4.0,
    "template_kwargs": ["enable_thinking"], "api_keys": ["k1", "k2"], "allow_keyless": True, "admin_key": "adm",
    "reward": "unit", "max_body_bytes": 4096, "max_messages": 8, "max_message_chars": 100, "max_tokens": 64,
}


def _service(raw: dict):
    return ClaasConfig.from_config({"service": raw}).service


def test_every_service_setting_is_a_recipe_key_and_reaches_the_running_service():
    # tenants: a job refuses it until its trainer trains one adapter per tenant (tests/claas/service/
    # test_service_tenants.py holds the refusal)
    settable = {f.name for f in fields(ServiceConfig)} - set(JOB_SET_SERVICE_FIELDS) - {"tenants"}
    assert set(NON_DEFAULTS) == settable, "a ServiceConfig field without a test value: add it to NON_DEFAULTS"
    for name, value in NON_DEFAULTS.items():
        assert value != next(f.default for f in fields(ServiceConfig) if f.name == name) or name == "api_keys"
    running = _service(NON_DEFAULTS).service_config(default_max_tokens=32)
    assert type(running) is ServiceConfig
    for name, value in NON_DEFAULTS.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(running, name) == expected, name
    assert running.default_max_tokens == 32 and running.adapter_root is None and running.record


@pytest.mark.parametrize("name", JOB_SET_SERVICE_FIELDS)
def test_the_fields_the_job_sets_are_refused_in_the_recipe(name):
    value = {"record": False, "default_scenario_id": 3, "adapter_root": "/tmp", "default_max_tokens": 8}[name]
    with pytest.raises(ValueError, match=f"claas.service.{name} is set by the job"):
        _service({name: value})


@pytest.mark.parametrize("name,value", [("max_grading", 0), ("sweep_interval_s", 0), ("ack_timeout_s", -1.0),
                                        ("rate_limit_burst", True), ("max_body_bytes", 0), ("reward", "float"),
                                        ("limit_concurrency", 0), ("port", 70000)])
def test_a_bad_value_names_its_yaml_key(name, value):
    with pytest.raises(ValueError, match=f"claas.service.{name}"):
        _service({name: value})


def test_the_job_section_needs_no_keys_until_start_but_the_service_does():
    section = _service({"enabled": True})
    with pytest.raises(ValueError, match="no API keys"):
        section.service_config()
    assert section.service_config(api_keys=("env-key",)).api_keys == ("env-key",)
