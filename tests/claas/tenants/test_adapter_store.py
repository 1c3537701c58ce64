"""Per-tenant adapters on a real PEFT LoRA: digests, lineage, swaps that equal training each tenant alone, and a
checkpoint that restores every tenant bit for bit (also after a save killed part way)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from claas_verl.claas.tenants.adapters import MANIFEST, TenantAdapterStore, adapter_digest, lora_parameters


def test_digest_names_exact_weights_by_name_dtype_shape_and_bytes():
    a = {"x.lora_A": torch.arange(6, dtype=torch.float32).reshape(2, 3), "x.lora_B": torch.zeros(3, 1)}
    # the format spelled out: per name (sorted) a length-prefixed JSON header, then the length-prefixed bytes
    h = hashlib.sha256()
    for name in ("x.lora_A", "x.lora_B"):
        t = a[name]
        for part in (json.dumps([name, "float32", list(t.shape)]).encode(), t.numpy().tobytes()):
            h.update(len(part).to_bytes(8, "big") + part)
    assert adapter_digest(a) == h.hexdigest()
    assert adapter_digest(dict(reversed(list(a.items())))) == adapter_digest(a)  # dict order does not matter
    flipped = a["x.lora_A"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # one bit of one weight
    variants = [
        {**a, "x.lora_A": flipped},
        {**a, "x.lora_A": a["x.lora_A"].reshape(3, 2)},  # same bytes, other shape
        {**a, "x.lora_B": torch.zeros(3, 1, dtype=torch.int32)},  # same bytes, other dtype
        {"y.lora_A": a["x.lora_A"], "x.lora_B": a["x.lora_B"]},  # other name
        {**a, "x.lora_A": a["x.lora_A"].t().contiguous().t()},  # a strided view hashes as its row-major values
    ]
    digests = [adapter_digest(v) for v in variants]
    assert len(set(digests[:4])) == 4 and adapter_digest(a) not in digests[:4]
    assert digests[4] == adapter_digest(a)
    assert adapter_digest({"w": torch.ones(2, dtype=torch.bfloat16)}) != adapter_digest({"w": torch.ones(2)})


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _lora_model(seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"]))
    with torch.no_grad():  # PEFT starts B at zero; a random B makes every parameter's gradient nonzero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _data(tenant: str, step: int):
    g = torch.Generator().manual_seed(hash((tenant, step)) % (1 << 31))
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def _step(model, opt, tenant, step):
    x, y = _data(tenant, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _interleaved(store, model, opt, schedule, start=0):
    for i, tenant in enumerate(schedule, start):
        store.swap_in(tenant, model, opt)
        _step(model, opt, tenant, i)
        store.swap_out(model, opt)


def _alone(tenant, steps):
    """Tenant ``tenant`` trained alone, with its own optimizer, on the same batches (indices ``steps``)."""
    model = _lora_model()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    for i in steps:
        _step(model, opt, tenant, i)
    return {n: p.detach().clone() for n, p in lora_parameters(model).items()}


SCHEDULE = ["a", "b", "a", "a", "b"]  # c gives no feedback: never updated


def test_interleaved_tenants_train_exactly_as_each_alone_and_an_idle_one_keeps_its_bytes():
    model = _lora_model()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    store = TenantAdapterStore(["a", "b", "c"], lora_parameters(model))
    initial = store.version("c")
    assert initial[0] == 0 and initial == store.version("a")
    _interleaved(store, model, opt, SCHEDULE)
    for tenant in ("a", "b"):
        steps = [i for i, t in enumerate(SCHEDULE) if t == tenant]
        alone = _alone(tenant, steps)
        assert adapter_digest(store[tenant].adapter) == adapter_digest(alone)  # bit for bit
        assert store[tenant].optimizer["state"][0]["step"].item() == len(steps)
    assert [v for v, _ in store["a"].lineage] == [0, 1, 2, 3] and [v for v, _ in store["b"].lineage] == [0, 1, 2]
    assert store.version("c") == initial and store["c"].optimizer is None
    assert all(t.device.type == "cpu" for s in ("a", "b", "c") for t in store[s].adapter.values())
    assert not opt.state  # no tenant's moments are left in the optimizer between updates
    sizes = store.host_bytes()
    params = sum(t.numel() for t in store["a"].adapter.values())
    # at rest: adapter fp32 + AdamW exp_avg + exp_avg_sq fp32 + one step scalar per parameter tensor
    assert sizes["a"] == params * 4 * 3 + len(store["a"].adapter) * 4
    assert sizes["c"] == params * 4


def test_swaps_are_refused_out_of_order():
    model = _lora_model()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    store = TenantAdapterStore(["a", "b"], lora_parameters(model))
    with pytest.raises(RuntimeError, match="no tenant is resident"):
        store.swap_out(model, opt)
    store.swap_in("a", model, opt)
    with pytest.raises(RuntimeError, match="'a' is still resident"):
        store.swap_in("b", model, opt)
    with pytest.raises(RuntimeError, match="resident: swap_out before saving"):
        store.save("/nonexistent")
    with pytest.raises(KeyError, match="no tenant 'z'"):
        store["z"]
    store.swap_out(model, opt)
    other = TenantAdapterStore(["a"], {"other.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="trainable parameters differ from the stored adapter"):
        other.swap_in("a", model, opt)


def _snapshot(store):
    """Every tenant's lineage, adapter (dtype, shape, bytes) and AdamW state (bytes), copied."""
    def tensors(d):
        return {k: (v.dtype, v.shape, v.numpy().tobytes()) for k, v in d.items()}

    return {t: (list(store[t].lineage), tensors(store[t].adapter),
                None if store[t].optimizer is None else
                {i: tensors(st) for i, st in store[t].optimizer["state"].items()})
            for t in store.tenants}


def test_checkpoint_restores_every_tenant_and_the_run_continues_identically(tmp_path):
    model = _lora_model()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    store = TenantAdapterStore(["a", "b", "c"], lora_parameters(model))
    _interleaved(store, model, opt, SCHEDULE)
    store.save(str(tmp_path))
    before = _snapshot(store)

    model2 = _lora_model()  # the same base model, another initial adapter: the adapters come from the checkpoint
    with torch.no_grad():
        for p in lora_parameters(model2).values():
            p.uniform_(-1, 1)
    opt2 = torch.optim.AdamW(lora_parameters(model2).values(), lr=1e-2)
    resumed = TenantAdapterStore(["a", "b", "c"], lora_parameters(model2))
    resumed.load(str(tmp_path))
    assert _snapshot(resumed) == before  # byte for byte: adapters, AdamW moments and steps, lineage

    more = ["b", "c", "a"]
    _interleaved(store, model, opt, more, start=len(SCHEDULE))
    _interleaved(resumed, model2, opt2, more, start=len(SCHEDULE))
    assert _snapshot(resumed) == _snapshot(store)


def test_a_save_killed_part_way_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    model = _lora_model()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    store = TenantAdapterStore(["a", "b"], lora_parameters(model))
    _interleaved(store, model, opt, ["a", "b"])
    store.save(str(tmp_path))
    saved = _snapshot(store)
    _interleaved(store, model, opt, ["a", "b"], start=2)

    real_save, calls = torch.save, []

    def dies_on_the_second_file(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-save")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        store.save(str(tmp_path))
    monkeypatch.setattr(torch, "save", real_save)
    resumed = TenantAdapterStore(["a", "b"], lora_parameters(_lora_model()))
    resumed.load(str(tmp_path))
    assert _snapshot(resumed) == saved  # the first save, whole: a's new file is not named by the manifest

    store.save(str(tmp_path))  # a later save replaces it and drops the files no manifest names
    files = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert files == ["a/s1-v2.pt", "b/s1-v2.pt", MANIFEST]


def test_a_tampered_file_or_other_tenants_are_refused(tmp_path):
    model = _lora_model()
    store = TenantAdapterStore(["a", "b"], lora_parameters(model))
    store.save(str(tmp_path))
    with pytest.raises(ValueError, match=r"holds tenants \['a', 'b'\], this job has \['a'\]"):
        TenantAdapterStore(["a"], lora_parameters(model)).load(str(tmp_path))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["tenants"]["b"]["file"] = manifest["tenants"]["a"]["file"]
    manifest["tenants"]["b"]["digest"] = "0" * 64
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="the file is not the saved one"):
        TenantAdapterStore(["a", "b"], lora_parameters(model)).load(str(tmp_path))
