"""Does verl's worker placement fit the Ray cluster? Checked before any worker group is created.

verl places each resource pool as placement groups, one per node entry of the pool (``trainer.nnodes`` entries of
``trainer.n_gpus_per_node`` workers), every worker a bundle ``{CPU: max_colocate_count, GPU: 1}`` (the GPU resource
is logical on CPU clusters) and all bundles of a group on ONE node (``STRICT_PACK``). verl itself only compares the
total GPU count; a group no node can hold (too few CPUs on the node that has the GPUs, GPUs spread over nodes) is
pending forever, and so is the job. The check reads the resources available when verl is about to place the pools:
the actors verl created before (TransferQueue's, 1 CPU each) are already counted; the ones it creates after (rollout
servers, agent-loop and reward workers) use Ray's default actor resources, which hold no CPU once placed and are
placed even on a node whose CPUs the groups took (measured with Ray 2.60).
"""

from __future__ import annotations


def _fmt(available: dict[str, float], total: dict[str, float] | None, device: str) -> str:
    def one(k: str) -> str:
        return f"{k} {available.get(k, 0):g}" + (f" of {total.get(k, 0):g}" if total is not None else "")

    parts = [one("CPU"), one(device)]
    if available.get("memory"):
        parts.append(f"memory {available['memory'] / 2**30:.1f} GiB")
    return ", ".join(parts)


def placement_problem(pool_spec: dict[str, list[int]], cpus_per_worker: float,
                      nodes: dict[str, dict[str, float]], device: str = "GPU",
                      totals: dict[str, dict[str, float]] | None = None) -> str | None:
    """Why the pools of ``pool_spec`` (``{pool: [workers on node 1, ...]}``) do not fit the ``nodes``' available
    resources (``{node: {"CPU": n, "GPU": n, ...}}``; ``totals``: the nodes' whole resources, for the message), or
    None when a first-fit placement of every group exists."""
    free = {n: {"CPU": float(r.get("CPU", 0)), device: float(r.get(device, 0))} for n, r in nodes.items()}
    groups = sorted(((pool, n) for pool, counts in pool_spec.items() for n in counts if n > 0), key=lambda g: -g[1])
    unplaced = []
    for pool, n in groups:
        need = {"CPU": n * cpus_per_worker, device: float(n)}
        fits = [k for k, r in free.items() if all(r[x] >= v for x, v in need.items())]
        if not fits:
            unplaced.append((pool, n))
            continue
        node = max(fits, key=lambda k: (free[k][device], free[k]["CPU"]))
        for x, v in need.items():
            free[node][x] -= v
    if not unplaced:
        return None
    workers = sum(n for counts in pool_spec.values() for n in counts)
    biggest = max((n for counts in pool_spec.values() for n in counts), default=0)
    needs = "; ".join(f"pool {pool}: {len(c)} node(s) x {c[0] if c else 0} worker(s)" for pool, c in pool_spec.items())
    totals = totals or {}
    have = "; ".join(f"node {k}: {_fmt(r, totals.get(k), device)}" for k, r in nodes.items()) or "no node"
    # CPUs the job's own earlier actors (TransferQueue) already hold on a node come on top of the workers'
    in_use = max((totals[k].get("CPU", 0) - r.get("CPU", 0) for k, r in nodes.items() if k in totals), default=0)
    cpus = int(biggest * cpus_per_worker + in_use)
    why = f"{len(unplaced)} worker group(s) fit no node ({', '.join(f'{p} x {n}' for p, n in unplaced)})"
    return (
        f"the Ray cluster cannot place this job's {workers} worker(s), so Ray would wait for them forever: {why}.\n"
        f"  needs: {needs}; each worker {{CPU: {cpus_per_worker:g}, {device}: 1}}, a node's workers on that one node "
        f"(at most {biggest} x {{CPU: {cpus_per_worker:g}, {device}: 1}} = CPU {biggest * cpus_per_worker:g}, "
        f"{device} {biggest})\n"
        f"  has (available now{' of total' if totals else ''}): {have}\n"
        f"  fix: give the nodes at least {cpus} CPUs (`ray start ... --num-cpus={cpus}`; a local cluster: "
        f"ray_kwargs.ray_init.num_cpus={cpus}) and {biggest} {device}s each, or lower trainer.n_gpus_per_node / "
        "trainer.nnodes"
    )


def check_placement(resource_pool_manager) -> None:
    """Raise ``RuntimeError`` when verl's pools (a ``ResourcePoolManager``) do not fit the connected cluster."""
    import ray
    from verl.plugin.platform import get_platform

    device = get_platform().ray_resource_name()  # "GPU" on CUDA and on claas_verl's CPU platform (logical GPUs)
    nodes, totals = {}, {}
    alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    for node_id, resources in ray._private.state.available_resources_per_node().items():
        if node_id in alive:
            name = f"{alive[node_id].get('NodeManagerAddress', '?')} ({node_id[:8]})"
            nodes[name], totals[name] = resources, dict(alive[node_id].get("Resources", {}))
    problem = placement_problem(dict(resource_pool_manager.resource_pool_spec),
                                float(resource_pool_manager.max_colocate_count), nodes, device, totals)
    if problem:
        raise RuntimeError(problem)
