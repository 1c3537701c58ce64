"""A Ray cluster too small for verl's worker placement fails at once, with the numbers and the fix, instead of a job
that waits forever for a placement group no node can hold."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from claas_verl.preflight.placement import placement_problem

REPO = Path(__file__).resolve().parents[2]


def test_verl_names_the_check_reads_still_exist():
    from verl.single_controller.ray.base import ResourcePoolManager

    names = {f.name for f in dataclasses.fields(ResourcePoolManager)}
    assert {"resource_pool_spec", "max_colocate_count"} <= names
    assert ResourcePoolManager.max_colocate_count == 3  # {CPU: 3, GPU: 1} per worker, as the messages below say


def test_a_head_with_two_cpus_cannot_hold_one_worker_of_three():
    """The hang observed: ``ray start --head --num-cpus=2 --num-gpus=1`` and mopd/seq scale=tiny (one worker)."""
    problem = placement_problem({"global_pool": [1]}, 3, {"head": {"CPU": 2, "GPU": 1, "memory": 8 * 2**30}})
    assert problem is not None
    assert "global_pool x 1" in problem and "{CPU: 3, GPU: 1}" in problem
    assert "node head: CPU 2, GPU 1, memory 8.0 GiB" in problem
    assert "--num-cpus=3" in problem and "ray_kwargs.ray_init.num_cpus=3" in problem
    # the job's TransferQueue actors already hold 2 of the node's 4 CPUs: the fix counts them
    held = placement_problem({"global_pool": [1]}, 3, {"head": {"CPU": 2, "GPU": 1}},
                             totals={"head": {"CPU": 4, "GPU": 1}})
    assert "node head: CPU 2 of 4, GPU 1 of 1" in held and "--num-cpus=5" in held


def test_placement_that_fits_and_the_ways_it_does_not():
    assert placement_problem({"global_pool": [2]}, 3, {"a": {"CPU": 6, "GPU": 2}}) is None
    assert "fit no node" in placement_problem({"global_pool": [2]}, 3, {"a": {"CPU": 5, "GPU": 2}})
    # enough GPUs in total (verl's own check passes) but a node's workers must share one node
    spread = {"a": {"CPU": 16, "GPU": 2}, "b": {"CPU": 16, "GPU": 2}}
    assert "fit no node" in placement_problem({"global_pool": [4]}, 3, spread)
    assert placement_problem({"global_pool": [2, 2]}, 3, spread) is None  # nnodes=2 x 2
    # the GPUs sit on a worker node, the CPUs on the head (the cluster layout of docs/cluster.md): the workers need both
    layout = {"head": {"CPU": 8, "GPU": 0}, "gpu": {"CPU": 2, "GPU": 1}}
    assert "fit no node" in placement_problem({"global_pool": [1]}, 3, layout)
    assert placement_problem({"global_pool": [1]}, 3, {**layout, "gpu": {"CPU": 3, "GPU": 1}}) is None


def test_main_mopd_on_a_cluster_with_too_few_cpus_fails_fast_with_the_numbers(tiny, tmp_path):
    """A real local Ray cluster of 2 CPUs and mopd/seq scale=tiny: before, verl's placement group waited forever."""
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny.root), CLAAS_OUT_DIR=str(tmp_path), PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "claas_verl.main_mopd", "--config-name=mopd/seq", "scale=tiny", "+verl@_global_=cpu",
           "trainer.experiment_name=too_small", "ray_kwargs.ray_init.num_cpus=2"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"main_mopd still waits for its placement after 600 s:\n{(e.stderr or b'')[-3000:]}")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert "cannot place this job's 1 worker(s)" in log and "ray_kwargs.ray_init.num_cpus=" in log, log[-6000:]
