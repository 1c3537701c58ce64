"""Versioned LoRA serving on a vLLM engine: every update is a NEW adapter id; no request ever runs on the base model.

verl 0.9.1 syncs a LoRA adapter into its vLLM rollout by removing the served adapter (one fixed id) and adding the new
one under the same id, then resetting the prefix cache. While the two steps run, verl's ``generate`` finds no adapter
loaded and serves new requests on the base model; requests running on the removed adapter lose it; and the prefix
cache is reset while requests run (vLLM refuses such a reset, so blocks cached under the reused adapter name stay
valid for the new weights). :class:`VersionedLoRAEngine` wraps the engine client of a vLLM server so that:

* a new adapter is added under a new id and name (the old one stays loaded);
* requests lease the adapter served when they start (:class:`~claas_verl.claas.adapter_switch.AdapterSwitch`) and
  keep it to their last token; the switch is one step, so a request gets either the old or the new adapter;
* the old adapter is removed from the engine once its last request ended;
* no prefix-cache reset is needed for a LoRA switch: vLLM keys cached KV blocks by the adapter's name, and every
  version has its own name, so no block of an old version is ever reused by a new one.

The verl glue that installs it in verl's vLLM server is :mod:`claas_verl.claas.vllm_versioned_lora`; this module
has no vLLM or verl import (the engine and the LoRA requests are duck-typed).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from claas_verl.claas.adapter_switch import AdapterSwitch

BASE = "<base>"  # the served "adapter" before the first one: the base model (never removed)
LORA_ID_BASE = 1_000_000  # versioned adapter ids start here (far from verl's fixed id 123)
MIN_CPU_LORAS = 2  # vLLM's adapter cache must hold the served adapter and the one its last requests still run on


def lora_name(lora_int_id: int) -> str:
    """The name of versioned adapter ``lora_int_id``: unique per adapter, so vLLM's prefix cache keys it apart."""
    return f"claas-lora-{lora_int_id}"


def next_lora_id(loaded_ids) -> int:
    """The id of the next adapter: one above the newest versioned id among ``loaded_ids`` (every worker of a server
    holds the same adapters, so each computes the same id)."""
    return max((int(i) for i in loaded_ids if int(i) > LORA_ID_BASE), default=LORA_ID_BASE) + 1


class VersionedLoRAEngine:
    """A vLLM engine client (``AsyncLLM``) whose requests run on the adapter served when they start.

    Args:
        engine: the engine client; ``generate(..., lora_request=...)``, ``add_lora``, ``remove_lora`` and
            ``list_loras`` are used, everything else is delegated unchanged.

    Use :meth:`load` to add an adapter and serve it, or :meth:`adopt` when the adapter was added to the engine's
    workers by another path (verl's weight sync); :attr:`served` tells which one new requests get.
    """

    def __init__(self, engine: Any):
        self._engine = engine
        self._requests: dict[str, Any] = {}  # served name -> the LoRA request object its requests carry
        self._switch = AdapterSwitch(BASE, 0, on_retire=self._retire, keep=(BASE,))
        self._tasks: set[asyncio.Task] = set()
        self.removed: list[int] = []  # adapter ids removed after their last request
        self.remove_errors: list[str] = []
        self.started: Counter = Counter()  # requests started per served adapter name (BASE: on the base model)

    def __getattr__(self, name: str):  # everything not overridden goes to the wrapped engine
        return getattr(self._engine, name)

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def served(self) -> tuple[str, int]:
        """``(adapter name or BASE, switch count)`` that new requests get."""
        current = self._switch.current
        return current.name, current.version

    def served_lora_id(self) -> int | None:
        request = self._requests.get(self._switch.current.name)
        return None if request is None else int(request.lora_int_id)

    def inflight(self, name: str | None = None) -> int:
        """Requests running on adapter ``name`` (default: the served one)."""
        return self._switch.inflight(self._switch.current.name if name is None else name)

    async def load(self, lora_request: Any) -> None:
        """Add ``lora_request`` (a new id and name) to the engine, then serve it; the old adapter is removed once its
        last request ends."""
        if lora_request.lora_name in self._requests or lora_request.lora_name == BASE:
            raise ValueError(f"adapter name {lora_request.lora_name!r} is already served; every version needs its own")
        if not await self._engine.add_lora(lora_request):
            raise RuntimeError(f"the engine refused to add adapter {lora_request.lora_name!r}")
        self.adopt(lora_request)

    def adopt(self, lora_request: Any) -> None:
        """Serve ``lora_request``, already added to the engine's workers, to every request that starts from now on."""
        if lora_request.lora_name in self._requests:
            raise ValueError(f"adapter name {lora_request.lora_name!r} is already served; every version needs its own")
        self._requests[lora_request.lora_name] = lora_request
        self._switch.switch(lora_request.lora_name, self._switch.current.version + 1)

    async def generate(self, *args, lora_request: Any = None, **kwargs):
        """The engine's ``generate`` on the adapter served now (the caller's ``lora_request`` is used only while the
        base model is served), holding that adapter until the request's last output."""
        lease = self._switch.acquire()
        self.started[lease.name] += 1
        try:
            served = self._requests.get(lease.name)
            async for output in self._engine.generate(*args, lora_request=served or lora_request, **kwargs):
                yield output
        finally:
            lease.release()

    def _retire(self, name: str) -> None:
        request = self._requests.pop(name, None)
        if request is None:
            return
        task = asyncio.get_running_loop().create_task(self._remove(int(request.lora_int_id)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, lora_int_id: int) -> None:
        try:
            await self._engine.remove_lora(lora_int_id)
            self.removed.append(lora_int_id)
        except Exception as exc:  # a failed removal leaks one cached adapter; it must not fail any request
            self.remove_errors.append(f"{lora_int_id}: {exc!r}")

    def state(self) -> dict:
        """What is served and what happened: ``served`` (name), ``served_lora_id``, ``switches``, ``started`` per
        adapter name, ``inflight`` of the served adapter, ``removed`` ids, ``remove_errors``."""
        name, switches = self.served
        return {"served": name, "served_lora_id": self.served_lora_id(), "switches": switches,
                "started": dict(self.started), "inflight": self.inflight(), "removed": list(self.removed),
                "remove_errors": list(self.remove_errors)}

    async def drain_removals(self) -> None:
        """Wait for the removals scheduled so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))


def check_rollout_config(config: Any) -> None:
    """``ValueError`` naming the key unless the vLLM rollout can keep an old adapter while a new one is served (and
    cache every adapter a batch may hold, when ``max_loras`` is raised)."""
    engine_kwargs = (config.actor_rollout_ref.rollout.get("engine_kwargs") or {}).get("vllm") or {}
    cpu_loras = engine_kwargs.get("max_cpu_loras")
    if cpu_loras is None or int(cpu_loras) < MIN_CPU_LORAS:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras must be >= {MIN_CPU_LORAS} (got {cpu_loras}): "
            "a LoRA update keeps the old adapter loaded until its running requests end (recipes/claas/common/"
            "paper_model.yaml sets 4)")
    max_loras = engine_kwargs.get("max_loras")
    if max_loras is not None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras must be an int >= 1, "
                             f"got {max_loras!r}")
        if int(cpu_loras) < max_loras:
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras={cpu_loras} is below "
                             f"max_loras={max_loras}: vLLM caches at least the adapters one batch holds")


def lift_max_loras(args: Any, engine_kwargs: Any) -> bool:
    """Set the vLLM server arguments' ``max_loras`` to ``engine_kwargs["max_loras"]`` when LoRA is on and the
    recipe asks for more than the arguments hold; True if it raised it.

    verl 0.9.1 merges ``engine_kwargs.vllm`` into the server arguments and then overwrites ``max_loras`` with 1
    (``vLLMHttpServer.launch_server``), so a batch holds one adapter: a new version's requests wait until the old
    one's finish, and tenants would take turns. The server applies this to the parsed arguments it hands to
    ``run_server``/``run_headless`` (docs/verl-couplings.md, "Tenants and verl's one-adapter engines")."""
    wanted = (engine_kwargs or {}).get("max_loras")
    if wanted is None or not getattr(args, "enable_lora", False):
        return False
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras must be an int >= 1, got {wanted!r}")
    if wanted <= int(getattr(args, "max_loras", 1) or 1):
        return False
    args.max_loras = wanted
    return True
