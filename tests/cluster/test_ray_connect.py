"""How the entry points decide between joining a running Ray cluster and starting one (no cluster started here).

``existing_cluster_address`` is Ray's own resolution of ``ray.init(address=None)``: ``RAY_ADDRESS``, else the
address that ``ray start`` recorded in Ray's default temp dir (``$RAY_TMPDIR/ray/ray_current_cluster``).
The file is written by hand here, in a temp dir of the test's own, so no other Ray on the machine is touched.
"""

from __future__ import annotations

import os

import pytest

from claas_verl.verl_ext.ray_connect import START_ONLY_KEYS, connect_kwargs, existing_cluster_address


@pytest.fixture
def recorded_cluster(tmp_path, monkeypatch):
    """A Ray default temp dir of our own holding a ``ray start`` record for 10.0.0.7:6379."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return "10.0.0.7:6379"


def test_suite_runs_with_ray_address_local():
    # tests/conftest.py: every test process and every subprocess it starts gets Ray's "start a new cluster"
    assert os.environ["RAY_ADDRESS"] == "local"


def test_recorded_cluster_is_ignored_under_the_suite_setting(recorded_cluster):
    assert existing_cluster_address() is None


def test_recorded_cluster_is_joined_without_ray_address(recorded_cluster, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS")
    assert existing_cluster_address() == recorded_cluster


def test_ray_address_wins_over_the_record(recorded_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6380")
    assert existing_cluster_address() == "10.0.0.9:6380"
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert existing_cluster_address() == "ray://head:10001"


def test_nothing_to_join_without_address_or_record(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert existing_cluster_address() is None


def test_connect_kwargs_drop_start_only_keys_and_merge_the_runtime_env():
    ray_init = {
        "num_cpus": 16, "num_gpus": 2, "include_dashboard": False, "timeline_json_file": None,
        "log_to_driver": True,
        "runtime_env": {"env_vars": {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}},
    }
    default = {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN"}, "working_dir": None}
    kwargs, ignored = connect_kwargs(ray_init, default, job_runtime_env=None)
    assert ignored == {"num_cpus": 16, "num_gpus": 2, "include_dashboard": False}
    assert kwargs == {
        "log_to_driver": True,
        "runtime_env": {
            "working_dir": None,
            "env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "VERL_PLATFORM": "cpu",
                         "OMP_NUM_THREADS": "1"},
        },
    }
    assert not set(kwargs) & set(START_ONLY_KEYS)


def test_connect_kwargs_leave_to_the_job_what_it_sets():
    # Ray refuses a driver runtime env that repeats a field or an env var of the submitted job's
    ray_init = {"num_cpus": 8, "runtime_env": {"env_vars": {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}}}
    job = {"working_dir": "gcs://_ray_pkg_x.zip",
           "env_vars": {"VERL_USE_EXTERNAL_MODULES": "m", "OMP_NUM_THREADS": "2"}}
    kwargs, ignored = connect_kwargs(ray_init, {"env_vars": {"NCCL_DEBUG": "WARN"}}, job_runtime_env=job)
    assert ignored == {"num_cpus": 8}
    assert kwargs == {"runtime_env": {"env_vars": {"NCCL_DEBUG": "WARN", "VERL_PLATFORM": "cpu"}}}
    # nothing left at all: no runtime_env argument
    kwargs, _ = connect_kwargs({"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}, {}, job_runtime_env=job)
    assert kwargs == {}


def test_ray_session_is_a_cluster_of_its_own(ray_session):
    """The suite's Ray cluster was started by this process, never joined (tests/cluster/test_submit.py runs this
    with a live head's address in RAY_ADDRESS, in CLAAS_TEST_FOREIGN_RAY, and recorded in Ray's temp dir)."""
    gcs = ray_session.get_runtime_context().gcs_address
    assert gcs != os.environ.get("CLAAS_TEST_FOREIGN_RAY")
    assert ray_session._private.worker._global_node.head  # a node this process started, not a connection
