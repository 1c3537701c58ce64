"""The driver side of a multi-tenant CLaaS job (``claas.service.tenants``): one trainer, one adapter per tenant.

Each update belongs to one tenant. Around verl's own step (its loop is not copied):

* ``prepare_step`` -> :meth:`TenantTraining.begin`: the :class:`~claas_verl.claas.tenants.scheduler.TenantScheduler`
  picks among the tenants whose replay partition holds ``B_min`` entries (oldest-ready first, a continuously ready
  tenant waits at most ``N - 1`` updates); the actor workers swap that tenant's adapter, AdamW state, schedule and
  SDPO teacher in (:mod:`claas_verl.claas.trainer.tenant_worker`); the sampler draws from its partition only; the
  REINFORCE++ estimator reads its own EMA statistics (:class:`TenantEmas`).
* verl's update (unchanged).
* ``on_step_end`` -> :meth:`TenantTraining.end`: the new adapter is exported (rank 0, a PEFT directory under
  ``<run>/tenant_adapters/<tenant>/v<version>``), the trainer's forward scores the serving probe, the state is
  swapped out (nothing of a tenant stays on the accelerator), the tenant's partition counts the update (its own age
  clock), and the serving engine loads the version NEXT TO the served one and serves it only if its probe
  log-probs match the trainer's (:class:`~claas_verl.claas.tenants.verify.VerifiedServing`). A mismatch keeps the
  tenant on its previous version, raises its alarm counter and logs; ``claas.service.max_probe_failures``
  mismatches stop the job.

Serving: the chat API serves the tenants from its own engine (:class:`~claas_verl.claas.service.hf_tenants.
TenantHFBackend`, multi-LoRA PEFT in the trainer's process), not from verl's rollout replicas, which serve one
adapter (docs/verl-couplings.md). Version 0 is the base model: verl's initial LoRA adapter has ``B = 0``, so it
computes the base model's function. The exported directories are read by the serving engine, so
``trainer.default_local_dir`` must be shared by the training ranks and the driver (as verl's checkpoints already
require).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import threading
from typing import Any

import ray

from claas_verl.claas.tenants.scheduler import TenantScheduler
from claas_verl.claas.tenants.verify import ReloadProbe, VerifiedServing, probe_ids
from claas_verl.metrics.served_check import ProbeTolerance

logger = logging.getLogger(__name__)

ADAPTERS_DIR = "tenant_adapters"  # <run>/tenant_adapters/<tenant>/v<version>: exported versions (serving reads)
TENANTS_DIR = "tenants"  # <checkpoint>/claas/tenants/: per-rank training state and the served adapters
STAGED = "staged"


class TenantEmas:
    """Per-tenant REINFORCE++ EMA statistics (docs/math.md §A.3.1): each tenant's ``b, v`` see only its own accepted
    rewards; before a tenant's update its statistics are copied into the one ``bound`` object the
    ``claas_rpp_ema`` estimator reads."""

    def __init__(self, rpp: Any, tenants):
        from claas_verl.claas.verl_losses import bind_rpp_ema_stats
        from claas_verl.losses.advantages import EmaRewardStats

        def stats():
            return EmaRewardStats(beta=rpp.beta, b0=rpp.b0, v0=rpp.v0, v_min=rpp.v_min)

        self.lock = threading.Lock()
        self.live = {t: stats() for t in tenants}
        self.bound = stats()
        bind_rpp_ema_stats(self.bound)

    def update_many(self, tenant: str, rewards) -> None:
        with self.lock:
            self.live[tenant].update_many(rewards)

    def snapshot_for_step(self, tenant: str) -> dict:
        with self.lock:
            self.bound.load_state_dict(self.live[tenant].state_dict())
        return {"claas/ema_baseline": self.bound.baseline, "claas/ema_variance": self.bound.variance}

    def state_dict(self) -> dict:
        with self.lock:
            return {t: s.state_dict() for t, s in self.live.items()}

    def load_state_dict(self, state: dict) -> None:
        if sorted(state) != sorted(self.live):
            raise ValueError(f"EMA statistics are saved for tenants {sorted(state)}, this job has {sorted(self.live)}")
        with self.lock:
            for t, s in state.items():
                self.live[t].load_state_dict(s)


def run_coroutine(coro):
    """Run ``coro`` to completion from synchronous trainer code, on a thread of its own (whatever event loop the
    calling thread may run)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="claas-tenant-reload") as pool:
        return pool.submit(asyncio.run, coro).result()


def buffer_summary(replay_actor: Any, tenants) -> dict:
    """The actor's ``summary``; with tenants, ``k`` and ``size`` summed over the partitions, ``uids`` concatenated
    in tenant order, and each partition's own summary under ``tenants``."""
    if not tenants:
        return ray.get(replay_actor.summary.remote())
    return _combined({t: ray.get(replay_actor.summary.remote(tenant=t)) for t in tenants}, tenants)


async def buffer_summary_async(replay_actor: Any, tenants) -> dict:
    """:func:`buffer_summary` from a coroutine (the checkpoint's capture)."""
    if not tenants:
        return await replay_actor.summary.remote()
    return _combined({t: await replay_actor.summary.remote(tenant=t) for t in tenants}, tenants)


def _combined(per: dict, tenants) -> dict:
    return {"k": sum(s["k"] for s in per.values()), "size": sum(s["size"] for s in per.values()),
            "uids": [u for t in tenants for u in per[t]["uids"]], "tenants": per}


class TenantTraining:
    """See the module docstring. ``worker_group``: verl's actor worker group (a tenants worker class);
    ``sampler``: the job's :class:`~claas_verl.claas.trainer.sampler.ClaasReplaySampler`."""

    def __init__(self, claas: Any, worker_group: Any, replay_actor: Any, sampler: Any, out_dir: str, *,
                 reinforce_ema: bool):
        s = claas.service
        self.names = s.tenant_names
        self.wg, self.replay, self.sampler = worker_group, replay_actor, sampler
        self.adapters_dir = os.path.join(out_dir, ADAPTERS_DIR)
        self.scheduler = TenantScheduler(self.names)
        self.ema = TenantEmas(claas.rpp, self.names) if reinforce_ema else None
        self.probe_tokens = s.probe_tokens
        self.max_failures = s.max_probe_failures
        self.verified: VerifiedServing | None = None
        self.trained: dict[str, tuple[int, str]] = {}  # each tenant's newest (version, digest) in the trainer
        self.served_paths: dict[str, str | None] = dict.fromkeys(self.names)  # the directory each tenant is served
        self.backend = None  # the chat API's TenantHFBackend (attach_backend)
        self.ids: list[int] | None = None
        self.current: str | None = None

    # ------------------------------------------------------------------ set-up and resume
    def setup(self, tokenizer, tolerance: ProbeTolerance | None = None) -> None:
        """Every tenant at version 0 on every rank (call after the SDPO teacher exists: it is each tenant's start)."""
        from claas_verl.claas.tenants.verify import DEFAULT_TOLERANCE

        self.trained = {t: tuple(v) for t, v in self.wg.claas_tenants_setup(list(self.names))[0].items()}
        self.verified = VerifiedServing(self.names, self.trained, tolerance or DEFAULT_TOLERANCE, self.max_failures)
        self.ids = probe_ids(tokenizer, self.probe_tokens)

    def restore(self, claas_dir: str, state: dict) -> None:
        """A resumed job: every rank's tenant state, then the scheduler, the served versions, the EMA statistics."""
        from claas_verl.claas.trainer.resume import ResumeMismatch

        root = os.path.join(claas_dir, TENANTS_DIR)
        self.trained = {t: tuple(v) for t, v in self.wg.claas_tenants_load(root)[0].items()}
        if {t: list(v) for t, v in self.trained.items()} != state["trained"]:
            raise ResumeMismatch(f"{root}: the tenants' adapters are {self.trained}, state.json records "
                                 f"{state['trained']}")
        self.scheduler.load_state_dict(state["scheduler"])
        self.verified.load_state_dict(state["verified"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        # served again from the run's own adapter directory, not from the checkpoint folder, which verl's checkpoint
        # retention may delete while the tenant is still served (an evicted adapter is reloaded from its path)
        self.served_paths = dict.fromkeys(self.names)
        for t, rel in state["served"].items():
            if rel is not None:
                target = os.path.join(self.adapters_dir, t, os.path.basename(rel))
                if os.path.exists(target):
                    shutil.rmtree(target)
                shutil.copytree(os.path.join(root, rel), target)
                self.served_paths[t] = target

    def attach_backend(self, backend) -> None:
        """The chat API's engine; on a resume every tenant's served version is loaded into it again (the adapter
        files saved with the checkpoint, each checked against the digest that was verified)."""
        from claas_verl.claas.trainer.resume import ResumeMismatch

        self.backend = backend
        for t in self.names:
            path = self.served_paths[t]
            if path is None:
                continue
            version, digest = self.verified.served(t)
            run_coroutine(backend.load_adapter(path, version=version, tenant=t))
            got = backend.adapter_sha256(t, version)
            if got != digest:
                raise ResumeMismatch(f"{path}: tenant {t!r} v{version} hashes to {got}, its verified digest is "
                                     f"{digest}")

    # ------------------------------------------------------------------ one update
    def begin(self) -> dict:
        """Pick the tenant of the next update, swap it in and point the sampler at its partition; its metrics."""
        ready = ray.get(self.replay.ready_tenants.remote())
        tenant = self.scheduler.pick(ready)
        if tenant is None:
            raise RuntimeError("a tenant update was started with no tenant's partition ready (the trainer waits "
                               "for one before each step)")
        self.wg.claas_tenant_swap_in(tenant)
        self.current = tenant
        self.sampler.tenant = tenant
        self.sampler.tenant_version = self.verified.served(tenant)[0]
        out = {"claas/tenant": self.names.index(tenant),
               "claas/tenant_worst_wait": self.scheduler.worst_wait[tenant]}
        if self.ema is not None:
            out.update(self.ema.snapshot_for_step(tenant))
        return out

    def end(self) -> dict:
        """Export, score, swap out and count the update of the current tenant, then serve its new version if the
        probe matches. Returns the update's record (for the trace)."""
        tenant = self.current
        if tenant is None:
            raise RuntimeError("no tenant update is in progress")
        staged = os.path.join(self.adapters_dir, tenant, STAGED)
        self.wg.claas_tenant_export(staged)
        trained_lp = self.wg.claas_tenant_probe(self.ids)[0]
        version, digest = self.wg.claas_tenant_swap_out()[0]
        self.current = None
        evicted = ray.get(self.replay.on_update.remote(tenant=tenant))
        before = self.trained[tenant]
        self.trained[tenant] = (version, digest)
        record = {"tenant": tenant, "version": version, "adapter_sha256": digest, "evicted_age": evicted}
        if version == before[0]:  # no applied step (a skipped SDPO step): nothing new to serve
            shutil.rmtree(staged, ignore_errors=True)
            return {**record, "served": False}
        path = os.path.join(self.adapters_dir, tenant, f"v{version}")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(staged, path)
        record["served"] = self._serve(tenant, version, digest, path, trained_lp)
        record["probe"] = self.verified.stats()["tenants"][tenant]
        return record

    def _serve(self, tenant: str, version: int, digest: str, path: str, trained_lp: list[float]) -> bool:
        from claas_verl.claas.service.backend import AdapterRejected

        def accept(served_lp: list[float]) -> bool:
            return self.verified.offer(tenant, version, digest, served_lp, trained_lp)

        previous = self.served_paths[tenant]
        try:
            run_coroutine(self.backend.load_adapter(path, version=version, tenant=tenant,
                                                    probe=ReloadProbe(self.ids, accept)))
        except AdapterRejected as exc:  # the alarm counted and logged it; the tenant keeps its previous version
            logger.warning("%s", exc)
            return False
        self.served_paths[tenant] = path
        if previous is not None:
            self._drop_older_than(tenant, previous)
        return True

    def _drop_older_than(self, tenant: str, keep_from: str) -> None:
        """Delete the tenant's exported versions older than ``keep_from`` (the one served until now stays: requests
        that started on it may need it reloaded)."""
        root = os.path.join(self.adapters_dir, tenant)
        floor = int(os.path.basename(keep_from)[1:])
        for name in os.listdir(root):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < floor:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    # ------------------------------------------------------------------ checkpoints and stats
    def save(self, claas_dir: str) -> dict:
        """Every rank's tenant state and a copy of each served adapter into ``claas_dir/tenants``; returns the
        state.json part."""
        root = os.path.join(claas_dir, TENANTS_DIR)
        self.wg.claas_tenants_save(root)
        served = {}
        for t, path in self.served_paths.items():
            if path is None:
                served[t] = None
                continue
            rel = os.path.join("served", t, os.path.basename(path))
            target = os.path.join(root, rel)
            if os.path.abspath(path) != os.path.abspath(target):
                if os.path.exists(target):
                    shutil.rmtree(target)
                shutil.copytree(path, target)
            served[t] = rel
        for t in self.names:  # served copies no state names any more
            tdir = os.path.join(root, "served", t)
            if os.path.isdir(tdir):
                for name in os.listdir(tdir):
                    if served[t] is None or name != os.path.basename(served[t]):
                        shutil.rmtree(os.path.join(tdir, name), ignore_errors=True)
        return {"trained": {t: list(v) for t, v in self.trained.items()}, "scheduler": self.scheduler.state_dict(),
                "verified": self.verified.state_dict(), "served": served,
                "ema": None if self.ema is None else self.ema.state_dict()}

    def stats(self) -> dict:
        """Per tenant: the trained and served (version, digest), updates granted, waits; the probe's alarms."""
        sched = self.scheduler.stats()
        verified = self.verified.stats()
        return {"bound": sched["bound"], "probe_failures_total": verified["probe_failures_total"],
                "tenants": {t: {"trained_version": self.trained[t][0], "trained_sha256": self.trained[t][1],
                                "served_version": verified["tenants"][t]["version"],
                                "served_sha256": verified["tenants"][t]["digest"],
                                "probe_failures": verified["tenants"][t]["probe_failures"],
                                **sched["tenants"][t]} for t in self.names}}
