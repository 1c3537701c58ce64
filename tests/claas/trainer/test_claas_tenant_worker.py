"""Per-tenant training state on two FSDP2 ranks (gloo): interleaved tenants train exactly as each alone.

Two processes shard the tiny student with a PEFT LoRA (``fully_shard`` per decoder layer and the root, as verl
does) and run :class:`TenantSlots` over a stand-in of verl's engine (its ``module``, ``optimizer`` and
``lr_scheduler``, which is all the slots touch) with an SDPO :class:`EmaTeacher`. Tenants ``a`` and ``b`` are
updated in the order ``a b a a b`` (``c`` never), each update on the rank's half of that tenant's batch, then a
warm-up learning-rate schedule step and an EMA step, as verl's update and the SDPO worker do. Each tenant must end
bit for bit where a job training it alone ends (adapter, EMA teacher, a schedule counted in its own updates), ``c``
must keep its initial bytes, the exported PEFT directory must hash to the version's digest and load in PEFT, and a
per-rank checkpoint must resume the interleaving identically.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from claas_verl.claas.tenants.adapters import adapter_file_digest, full_adapter, lora_digest, lora_parameters

SCHEDULE = ["a", "b", "a", "a", "b"]
MORE = ["b", "a"]
TIMEOUT_S = 300


def _model(student: str):
    """The tiny student with a PEFT LoRA (r 4 on q/v, B random so every parameter has a gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _engine(student: str, sharded: bool, device: str = "cpu"):
    """A stand-in of verl's FSDP engine: its ``module`` (FSDP2 over each decoder layer and the root, as verl
    wraps it), ``optimizer`` and ``lr_scheduler``; and an SDPO EMA teacher over the LoRA."""
    from torch.distributed.fsdp import fully_shard

    from claas_verl.losses.sdpo import EmaTeacher

    model = _model(student).to(device)
    if sharded:
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # warm-up: the count matters
    return SimpleNamespace(module=model, optimizer=opt, lr_scheduler=sched), EmaTeacher(model, tau=0.5)


def _update(engine, ema, tenant: str, step: int, rank: int, device: str = "cpu") -> None:
    """One update of ``tenant`` on this rank's half of its batch (4 sequences of 12 random tokens)."""
    g = torch.Generator().manual_seed(1000 * ord(tenant) + step)
    ids = torch.randint(3, 200, (4, 12), generator=g)[2 * rank:2 * rank + 2].to(device)
    engine.optimizer.zero_grad()
    engine.module(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer.step()
    engine.lr_scheduler.step()
    ema.update(engine.module)


def _full_ema(ema) -> dict:
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in sorted(ema.params.items())}


def _rank_main(rank: int, init_file: str, out_dir: str, student: str):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from claas_verl.claas.trainer.tenant_worker import TenantSlots

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out = {"alone": {}}
        for tenant in ("a", "b"):  # each tenant trained alone, on the same batches (indices of SCHEDULE + MORE)
            engine, ema = _engine(student, sharded=True)
            for i, t in enumerate(SCHEDULE + MORE):
                if t == tenant:
                    _update(engine, ema, t, i, rank)
            out["alone"][tenant] = {"adapter": full_adapter(lora_parameters(engine.module)), "ema": _full_ema(ema),
                                    "lr": engine.optimizer.param_groups[0]["lr"]}

        engine, ema = _engine(student, sharded=True)
        slots = TenantSlots(["a", "b", "c"], engine, ema)
        out["initial"] = slots.store.version("c")
        for i, t in enumerate(SCHEDULE):
            slots.swap_in(t)
            _update(engine, ema, t, i, rank)
            if i == len(SCHEDULE) - 1:
                out["exported"] = slots.export(os.path.join(out_dir, "export_b"))
            slots.swap_out()
        out["after_schedule"] = {t: slots.store.version(t) for t in "abc"}
        assert not engine.optimizer.state  # nothing of any tenant left in the optimizer between updates
        slots.save(os.path.join(out_dir, "ckpt"))

        # resume into a fresh engine whose own adapter was perturbed: everything comes from the checkpoint
        engine2, ema2 = _engine(student, sharded=True)
        with torch.no_grad():
            for p in lora_parameters(engine2.module).values():
                p.to_local().uniform_(-1, 1)
        resumed = TenantSlots(["a", "b", "c"], engine2, ema2)
        resumed.load(os.path.join(out_dir, "ckpt"))
        for run, (eng, em) in ((slots, (engine, ema)), (resumed, (engine2, ema2))):
            for i, t in enumerate(MORE, len(SCHEDULE)):
                run.swap_in(t)
                _update(eng, em, t, i, rank)
                run.swap_out()
        out["continued"] = {t: slots.store.version(t) for t in "abc"}
        out["resumed"] = {t: resumed.store.version(t) for t in "abc"}
        out["interleaved"] = {}
        for t in ("a", "b"):
            slots.swap_in(t)
            out["interleaved"][t] = {"adapter": full_adapter(lora_parameters(engine.module)), "ema": _full_ema(ema),
                                     "lr": engine.optimizer.param_groups[0]["lr"]}
            slots.swap_out()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tenant_worker")
    ctx = mp.start_processes(_rank_main, args=(str(tmp / "pg"), str(tmp), str(tiny.student)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish in {TIMEOUT_S} s (mismatched collectives?)")
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_interleaved_tenants_on_two_fsdp2_ranks_equal_each_tenant_alone(ranks):
    _, (r0, r1) = ranks
    assert r0["after_schedule"] == r1["after_schedule"]  # every rank names each version alike
    for t in ("a", "b"):
        alone, mixed = r0["alone"][t], r0["interleaved"][t]
        assert lora_digest(mixed["adapter"]) == lora_digest(alone["adapter"])  # bit for bit
        for n in alone["ema"]:
            assert torch.equal(mixed["ema"][n], alone["ema"][n]), n  # the tenant's own EMA teacher
        assert mixed["lr"] == alone["lr"]  # its schedule counted its own updates
        assert r0["continued"][t] == (SCHEDULE.count(t) + MORE.count(t), lora_digest(alone["adapter"]))
    assert r0["alone"]["a"]["lr"] != r0["alone"]["b"]["lr"]  # 4 and 3 warm-up steps: a shared count would fail
    assert r0["continued"]["c"] == r0["initial"] and r0["initial"][0] == 0  # never updated: its initial bytes


def test_a_per_rank_checkpoint_resumes_every_tenant_exactly(ranks):
    tmp, (r0, r1) = ranks
    assert r0["resumed"] == r0["continued"] and r1["resumed"] == r1["continued"]
    assert sorted(os.listdir(tmp / "ckpt")) == ["rank_0", "rank_1"]  # each rank saved its own shards


def test_the_exported_adapter_is_the_served_version_and_loads_in_peft(ranks, tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, (r0, r1) = ranks
    assert r0["exported"] == str(tmp / "export_b") and r1["exported"] is None  # rank 0 writes it
    assert adapter_file_digest(tmp / "export_b") == r0["after_schedule"]["b"][1]
    base = AutoModelForCausalLM.from_pretrained(str(tiny.student), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp / "export_b"))
    exported = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(exported) == set(lora_parameters(_model(str(tiny.student))))  # PEFT found every tensor
    assert lora_digest(exported) == r0["after_schedule"]["b"][1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_interleaved_tenants_on_cuda_equal_each_alone(tiny, tmp_path):
    """The same swap on one CUDA device under FSDP2 (nccl): the moments rebuilt on the GPU, AdamW's ``step`` where
    AdamW keeps it; each tenant ends where it ends alone (to 1e-6: cuBLAS reductions need not be bit-stable)."""
    import torch.distributed as dist

    from claas_verl.claas.trainer.tenant_worker import TenantSlots

    student = str(tiny.student)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        alone = {}
        for tenant in ("a", "b"):
            engine, ema = _engine(student, sharded=True, device="cuda")
            for i, t in enumerate(SCHEDULE):
                if t == tenant:
                    _update(engine, ema, t, i, 0, device="cuda")
            alone[tenant] = full_adapter(lora_parameters(engine.module))
        engine, ema = _engine(student, sharded=True, device="cuda")
        slots = TenantSlots(["a", "b"], engine, ema)
        for i, t in enumerate(SCHEDULE):
            slots.swap_in(t)
            _update(engine, ema, t, i, 0, device="cuda")
            slots.swap_out()
            assert not engine.optimizer.state
        for tenant in ("a", "b"):
            slots.swap_in(tenant)
            mixed = full_adapter(lora_parameters(engine.module))
            slots.swap_out()
            for n in alone[tenant]:
                torch.testing.assert_close(mixed[n], alone[tenant][n], rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
