"""VersionedLoRAEngine's decisions on an in-memory engine: which adapter serves which request, when the old one is
removed, and that a switch never leaves a request on the base model (the real-vLLM test is
test_lora_versions_vllm.py, ``make test-vllm``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from claas_verl.claas.lora_versions import LORA_ID_BASE, VersionedLoRAEngine, lora_name, next_lora_id


class Engine:
    """Stands in for vLLM's AsyncLLM: loaded adapter ids, and a request that yields ``steps`` outputs, each after
    ``gate`` is set (tests hold a request mid-generation that way). Records the adapter of every request."""

    def __init__(self):
        self.loaded: set[int] = set()
        self.served: list[tuple[str, int | None]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.resets = 0

    async def add_lora(self, request):
        self.loaded.add(request.lora_int_id)
        return True

    async def remove_lora(self, lora_id):
        self.loaded.remove(lora_id)
        return True

    async def list_loras(self):
        return set(self.loaded)

    async def reset_prefix_cache(self):
        self.resets += 1

    async def generate(self, prompt, sampling_params, request_id, *, lora_request=None, priority=0):
        lid = None if lora_request is None else lora_request.lora_int_id
        assert lid is None or lid in self.loaded, f"request {request_id} on adapter {lid}, which is not loaded"
        self.served.append((request_id, lid))
        for step in range(2):
            await self.gate.wait()
            assert lid is None or lid in self.loaded, f"adapter {lid} removed under request {request_id}"
            yield SimpleNamespace(request_id=request_id, step=step, lora=lid)


def lora(i: int):
    return SimpleNamespace(lora_name=lora_name(LORA_ID_BASE + i), lora_int_id=LORA_ID_BASE + i, lora_path="/x")


async def collect(engine, rid, **kw):
    return [o async for o in engine.generate("p", None, rid, **kw)]


def test_requests_keep_their_adapter_and_the_old_one_goes_when_its_last_request_ends():
    async def run():
        raw = Engine()
        eng = VersionedLoRAEngine(raw)
        await collect(eng, "base")  # before any adapter: the base model
        await eng.load(lora(1))
        raw.gate.clear()
        long = asyncio.get_running_loop().create_task(collect(eng, "long"))  # held on v1
        await asyncio.sleep(0.01)
        assert eng.inflight() == 1 and raw.served[-1] == ("long", LORA_ID_BASE + 1)
        await eng.load(lora(2))  # the switch: new requests get v2 at once, v1 stays loaded for "long"
        assert eng.served_lora_id() == LORA_ID_BASE + 2 and raw.loaded == {LORA_ID_BASE + 1, LORA_ID_BASE + 2}
        raw.gate.set()
        new = await collect(eng, "new")
        assert [o.lora for o in new] == [LORA_ID_BASE + 2] * 2
        assert [o.lora for o in await long] == [LORA_ID_BASE + 1] * 2
        await eng.drain_removals()
        assert eng.removed == [LORA_ID_BASE + 1] and raw.loaded == {LORA_ID_BASE + 2}
        # A third adapter with nothing running on v2: v2 goes at once; the base model is never "removed".
        await eng.load(lora(3))
        await eng.drain_removals()
        assert eng.removed == [LORA_ID_BASE + 1, LORA_ID_BASE + 2] and raw.loaded == {LORA_ID_BASE + 3}
        assert raw.resets == 0 and eng.remove_errors == []
        # Delegation: everything else reaches the engine unchanged.
        assert await eng.list_loras() == {LORA_ID_BASE + 3}
        return raw.served

    served = asyncio.run(run())
    assert served == [("base", None), ("long", LORA_ID_BASE + 1), ("new", LORA_ID_BASE + 2)]


def test_adopt_serves_an_adapter_loaded_elsewhere_and_names_are_never_reused():
    async def run():
        raw = Engine()
        eng = VersionedLoRAEngine(raw)
        raw.loaded.add(LORA_ID_BASE + 1)  # added by verl's weight sync, in the workers
        eng.adopt(lora(1))
        out = await collect(eng, "a", lora_request=SimpleNamespace(lora_int_id=123, lora_name="verl"))
        assert [o.lora for o in out] == [LORA_ID_BASE + 1] * 2  # the caller's (verl's fixed) adapter is replaced
        with pytest.raises(ValueError, match="already served"):
            eng.adopt(lora(1))

    asyncio.run(run())
    assert next_lora_id({123}) == LORA_ID_BASE + 1 and next_lora_id({123, LORA_ID_BASE + 4}) == LORA_ID_BASE + 5
