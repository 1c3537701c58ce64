"""docs/cluster.md's commands, run as written: token auth, ``ray start``, ``ray job submit`` of the tiny recipes.

The nodes run an interpreter without claas_verl (``bare_python``): the package reaches the jobs only through
the ``working_dir`` upload, and verl loads its plugin only through ``VERL_USE_EXTERNAL_MODULES``. The jobs
are submitted from a copy of this checkout into which the folders Ray must not upload (``.venv``, build
outputs, run folders) were planted; the test then reads what Ray unpacked on the node. Every node has its
own temp dir and free ports, and only the test's own processes are stopped (``tests/cluster/conftest.py``).

Slow (minutes): one Ray head (30 s on a loaded 2-core host) and two tiny verl jobs; the multi-node test
starts a second node.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")
RUNTIME_ENV = json.dumps({"working_dir": ".", "env_vars": {"VERL_USE_EXTERNAL_MODULES": "claas_verl.verl_ext.plugin"}})
MOPD_FAST = ("mopd.train.max_response_length=12", "mopd.eval.prompts=2", "trainer.save_freq=-1")


@pytest.fixture(scope="module")
def tiny_root() -> Path:
    from claas_verl.tiny import ensure_tiny

    return Path(ensure_tiny().root)


def _head(nodes, free_port, *resources: str, temp: str = "head") -> str:
    """The documented auth step and head start; returns the dashboard address."""
    nodes.sh("ray", "get-auth-token", "--generate")
    assert (nodes.home / ".ray" / "auth_token").is_file()
    dash = free_port()
    out = nodes.start("--head", f"--port={free_port()}", f"--dashboard-port={dash}", *resources,
                f"--temp-dir={nodes.temp / temp}", "--disable-usage-stats")
    # what `ray start --head` prints for the workers: ray start --address='IP:PORT'
    nodes.head_gcs_address = re.search(r"ray start --address='([^']+)'", out).group(1)
    return f"http://127.0.0.1:{dash}"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # the CLI colours its output


def _submit(nodes, address: str, checkout: Path, job_id: str, *entrypoint: str) -> str:
    for _ in range(24):
        proc = nodes.sh("ray", "job", "submit", "--address", address, "--submission-id", job_id,
                        "--runtime-env-json", RUNTIME_ENV, "--", *entrypoint, cwd=checkout, timeout=2400, check=False)
        log = proc.stdout + proc.stderr
        # right after `ray start` on a loaded host the head's agent may not be up yet (nothing was submitted)
        if proc.returncode == 0 or "No available agent to submit job" not in log:
            break
        time.sleep(5)
    status = nodes.sh("ray", "job", "status", "--address", address, job_id, check=False)
    assert proc.returncode == 0 and f"Job '{job_id}' succeeded" in _plain(status.stdout + status.stderr), log[-8000:]
    assert "claas_verl: joining the running Ray cluster at" in _plain(log), log[-4000:]
    return log


def _uploaded_dirs(temp_dir: Path) -> list[Path]:
    return sorted((temp_dir / "session_latest" / "runtime_resources" / "working_dir_files").glob("*/"))


def _check_upload(temp_dir: Path, planted: tuple[str, ...]) -> None:
    """What Ray unpacked on the node: the package and recipes, none of the planted folders, a small total."""
    dirs = _uploaded_dirs(temp_dir)
    assert dirs, f"no working_dir unpacked under {temp_dir}"
    for d in dirs:
        top = {p.name for p in d.iterdir()}
        assert {"claas_verl", "recipes", "setup.py", "README.md"} <= top, top
        # the jobs run in this folder and write into it (Hydra's outputs/<date>/), so look for the planted files
        uploaded = [p for p in (*planted, ".git") if (d / p).exists()]
        assert not uploaded, f"uploaded: {uploaded}"
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        assert size < 20 * 2**20, f"working_dir upload is {size / 2**20:.1f} MiB"
        print(f"working_dir upload: {sum(1 for p in d.rglob('*') if p.is_file())} files, {size / 2**20:.2f} MiB")


def _check_mopd(run_dir: Path, tiny_root: Path, steps: int | None = None) -> None:
    """``steps.jsonl`` equals the plan (its first ``steps`` steps when ``trainer.total_training_steps`` cut it)."""
    plan = subprocess.run(
        [sys.executable, "-m", "claas_verl.plan", "--config-name", "mopd/seq", "scale=tiny", "plan.format=json"],
        cwd=REPO, capture_output=True, text=True, check=True, env={**os.environ, "CLAAS_TINY_DIR": str(tiny_root)})
    expected = json.loads(plan.stdout)["steps"]
    assert len(expected) == 10  # tiny_seq: 4 + 3 + 3 blocks
    done = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]
    assert [{k: s[k] for k in PLAN_KEYS} for s in done] == expected[:steps]
    for s in done:
        assert math.isfinite(s["metrics"]["actor/grad_norm"]) and s["metrics"]["actor/grad_norm"] > 0
    if steps is None:
        assert (run_dir / "forgetting.md").is_file()


def _check_claas(run_dir: Path) -> None:
    metrics = json.loads((run_dir / "continual_metrics.json").read_text())
    assert metrics["K"] == 2 and len(metrics["M"]) == 2
    assert all(0.0 <= v <= 1.0 for row in metrics["M"] for v in row)
    assert metrics["updates"] >= 1
    stats = metrics["buffer_stats"]
    assert stats["sample_calls"] == stats["update_count"] == metrics["updates"]
    assert stats["max_uses"] <= 2 + 1  # tiny_reinforce_pp: A_max = 2
    for key in ("forward_transfer", "forgetting", "final"):
        assert metrics[key] is not None and math.isfinite(metrics[key])


def test_submit_tiny_mopd_and_claas_to_a_head(ray_nodes, checkout, planted, free_port, tiny_root, tmp_path):
    ray_nodes.env["CLAAS_TINY_DIR"] = str(tiny_root)
    out = tmp_path / "out"
    address = _head(ray_nodes, free_port, "--num-cpus=16", "--num-gpus=1")
    _submit(ray_nodes, address, checkout, "tiny-seq",
            "python", "-m", "claas_verl.main_mopd", "--config-name", "mopd/seq", "scale=tiny",
            "trainer.experiment_name=tiny_seq_cluster", f"trainer.default_local_dir={out}/tiny_seq", *MOPD_FAST)
    _check_mopd(out / "tiny_seq", tiny_root)
    _submit(ray_nodes, address, checkout, "tiny-rpp",
            "python", "-m", "claas_verl.main_claas", "--config-name", "claas/reinforce_pp", "scale=tiny",
            "trainer.experiment_name=tiny_rpp_cluster", f"trainer.default_local_dir={out}/tiny_rpp",
            "claas.producer.max_new_tokens=8")
    _check_claas(out / "tiny_rpp")
    _check_upload(ray_nodes.temp / "head", planted)


def test_submit_to_a_two_node_cluster(ray_nodes, checkout, planted, free_port, tiny_root, tmp_path):
    """The documented multi-node example as two Ray nodes on this machine, each with its own temp dir.

    The head has no (logical) GPU, so verl's training rank can only be placed on the worker node.
    """
    ray_nodes.env["CLAAS_TINY_DIR"] = str(tiny_root)
    out = tmp_path / "out"
    address = _head(ray_nodes, free_port, "--num-cpus=8", "--num-gpus=0")
    gcs = ray_nodes.head_gcs_address
    ray_nodes.start(f"--address={gcs}", "--num-cpus=8", "--num-gpus=1", f"--temp-dir={ray_nodes.temp / 'worker'}",
                    "--disable-usage-stats")
    nodes = ray_nodes.sh("python", "-c", f"import ray; ray.init(address={gcs!r}, log_to_driver=False);"
                         "print(sorted(n['Resources'].get('GPU', 0) for n in ray.nodes() if n['Alive']))"
                         ).stdout.strip().splitlines()[-1]
    assert nodes == "[0, 1.0]", nodes  # two live nodes, the logical GPU on the worker
    steps = 3
    _submit(ray_nodes, address, checkout, "tiny-seq-2nodes",
            "python", "-m", "claas_verl.main_mopd", "--config-name", "mopd/seq", "scale=tiny",
            f"trainer.total_training_steps={steps}",
            "trainer.experiment_name=tiny_seq_2nodes", f"trainer.default_local_dir={out}/tiny_seq_2nodes",
            "mopd.train.max_response_length=12", "mopd.eval.enabled=false", "trainer.save_freq=-1")
    _check_mopd(out / "tiny_seq_2nodes", tiny_root, steps=steps)
    _check_upload(ray_nodes.temp / "worker", planted)  # the training rank's node unpacked the working_dir too


def test_the_suite_ignores_a_running_cluster(ray_nodes, free_port):
    """A live head, as a stale ``ray start`` leaves it: its address in RAY_ADDRESS and recorded in Ray's temp dir.

    Outside the suite, the entry points would join it (control). The suite's own tests, run in a child pytest
    with that environment, start their own cluster, and no driver ever connects to the head.
    """
    _head(ray_nodes, free_port, "--num-cpus=1", "--num-gpus=0", temp="ray")  # record: <temp>/ray/ray_current_cluster
    gcs = ray_nodes.head_gcs_address
    env = {**ray_nodes.env, "RAY_TMPDIR": str(ray_nodes.temp), "PYTHONPATH": str(REPO)}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(ray_nodes.python.parent))
    control = subprocess.run(
        [sys.executable, "-c", "from claas_verl.verl_ext.ray_connect import existing_cluster_address as a; print(a())"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert control.stdout.strip().splitlines()[-1] == gcs, control.stdout + control.stderr[-2000:]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cluster/test_ray_connect.py"],
        cwd=REPO, env={**env, "RAY_ADDRESS": gcs, "CLAAS_TEST_FOREIGN_RAY": gcs},
        capture_output=True, text=True, timeout=900)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]
    drivers = ray_nodes.sh(str(ray_nodes.python), "-c", f"import ray; ray.init(address={gcs!r}, log_to_driver=False);"
                           "print(len(ray._private.state.jobs()))").stdout.strip().splitlines()[-1]
    assert drivers == "1", f"{drivers} drivers connected to the head; only this probe should have"
