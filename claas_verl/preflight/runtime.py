"""Which verl runtime group (``recipes/<system>/verl/{cpu,gpu}.yaml``) a run gets, from where its workers run.

The workers run on the Ray cluster's nodes, not on the driver: under ``ray job submit`` the driver is on the head,
which often has no GPU at all (``ray start --head --num-gpus=0``). So with a running cluster the choice is read from
its nodes: Ray labels a node whose GPUs it detected with an ``accelerator_type:<model>`` resource; GPUs without that
label are logical ones (``ray start --num-gpus=N`` on a CPU machine, as the CPU cluster commands of docs/cluster.md
start). Without a running cluster, the local cluster the run starts is this machine, so its CUDA decides.
"""

from __future__ import annotations

ACCELERATOR_PREFIX = "accelerator_type:"
OVERRIDE = "+verl@_global_=gpu (or =cpu)"


def runtime_for_nodes(nodes: list[dict[str, float]]) -> str:
    """``gpu`` when every node with GPU resources has detected GPUs, ``cpu`` when none has (logical GPUs, or no
    GPU at all); a cluster mixing both is refused."""
    with_gpus = [r for r in nodes if r.get("GPU", 0) > 0]
    detected = [r for r in with_gpus if any(k.startswith(ACCELERATOR_PREFIX) for k in r)]
    if not detected:
        return "cpu"
    if len(detected) == len(with_gpus):
        return "gpu"
    raise ValueError(
        f"the Ray cluster mixes {len(detected)} node(s) with detected GPUs and {len(with_gpus) - len(detected)} with "
        f"logical GPUs only (no {ACCELERATOR_PREFIX}* resource), so the verl runtime is ambiguous: name it with "
        f"{OVERRIDE}, or start the nodes alike"
    )


def cluster_nodes(address: str) -> list[dict[str, float]]:
    """The resources of every alive node of the cluster at ``address`` (connects briefly unless connected)."""
    import ray

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    finally:
        if not connected:
            ray.shutdown()  # the entry point joins again with the job's runtime environment


def choose_runtime(cuda_here: bool) -> tuple[str, str]:
    """(group, why): from the running cluster's nodes when there is one, else from this machine's CUDA."""
    from claas_verl.verl_ext.ray_connect import existing_cluster_address

    address = existing_cluster_address()
    if address is None:
        return ("gpu" if cuda_here else "cpu"), f"no running Ray cluster; CUDA {'present' if cuda_here else 'absent'}"
    group = runtime_for_nodes(cluster_nodes(address))
    return group, f"the Ray cluster at {address} has {'detected' if group == 'gpu' else 'no detected'} GPUs"
