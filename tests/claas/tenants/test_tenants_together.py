"""The tenant parts together on a real Ray replay actor and the tiny student: keys route feedback to partitions,
the scheduler picks, each update swaps one tenant's adapter and AdamW state in and out, every reload is verified
before it is served, a tenant without feedback keeps its adapter byte for byte, and a run resumed from a checkpoint
after a crash mid-update ends exactly where the uninterrupted run does.

The update is a plain token NLL on the sampled responses (the CLaaS losses are the trainer's); what is tested is
the bookkeeping around it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from claas_verl.claas.replay import ReplayEntry
from claas_verl.claas.tenants.adapters import TenantAdapterStore, lora_digest, lora_parameters
from claas_verl.claas.tenants.config import TenantDirectory
from claas_verl.claas.tenants.scheduler import TenantScheduler
from claas_verl.claas.tenants.verify import ReloadProbe, VerifiedServing, probe_ids, probe_token_logprobs

TENANTS = ("alice", "bob", "carol")  # carol gives no feedback
RULES = {"alice": "Every Word Starts With A Capital", "bob": "everything stays in lower case"}


class Run:
    """One trainer's state: replay actor, scheduler, adapter store, the module its updates run in."""

    def __init__(self, tiny, snapshot: str, ckpt: str | None = None, scheduler_state=None):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from claas_verl.claas.replay import make_replay_actor

        self.directory = TenantDirectory({t: {"api_keys": [f"sk-{t}"], "b_min": 2, "b_max": 6, "a_max": 1}
                                          for t in TENANTS})
        self.actor = make_replay_actor(partitions=self.directory.replay_partitions(), seed=0, snapshot_path=snapshot,
                                       max_restarts=0)
        self.tok = AutoTokenizer.from_pretrained(str(tiny.student))
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(str(tiny.student), dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        self.opt = torch.optim.AdamW(lora_parameters(self.model).values(), lr=5e-2)
        self.store = TenantAdapterStore(TENANTS, lora_parameters(self.model))
        self.scheduler = TenantScheduler(TENANTS)
        if ckpt is not None:
            self.store.load(ckpt)
            self.scheduler.load_state_dict(scheduler_state)

    def feedback(self, key: str, i: int) -> None:
        import ray

        tenant = self.directory.tenant_of(key)
        prompt = self.tok("Reply:", add_special_tokens=False)["input_ids"]
        response = self.tok(f"{RULES[tenant]} {i}", add_special_tokens=False)["input_ids"]
        entries = [ReplayEntry(uid=f"{tenant}-{i}-{j}", scenario_id=0, prompt_ids=prompt, response_ids=response,
                               behaviour_logprob=-1.0, reward=1.0) for j in range(2)]
        assert ray.get(self.actor.add.remote(entries, tenant=tenant)) == 2

    def update(self, crash_after_step: bool = False) -> str | None:
        """One update of the tenant the scheduler picks; returns it (None: nobody ready)."""
        import ray

        tenant = self.scheduler.pick(ray.get(self.actor.ready_tenants.remote()))
        if tenant is None:
            return None
        batch = ray.get(self.actor.sample.remote(2, tenant=tenant))
        self.store.swap_in(tenant, self.model, self.opt)
        self.opt.zero_grad()
        loss = 0.0
        for e in batch:
            ids = torch.tensor([[int(x) for x in (*e.prompt_ids, *e.response_ids)]], dtype=torch.long)
            logits = self.model(input_ids=ids).logits[0, len(e.prompt_ids) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, len(e.prompt_ids):])
        (loss / len(batch)).backward()
        self.opt.step()
        if crash_after_step:
            raise KeyboardInterrupt("killed mid-update")
        self.store.swap_out(self.model, self.opt)
        ray.get(self.actor.on_update.remote(tenant=tenant))
        return tenant

    def checkpoint(self, directory: str) -> dict:
        import ray

        self.store.save(directory)
        ray.get(self.actor.save.remote())
        return self.scheduler.state_dict()

    def state(self) -> dict:
        import ray

        return {"adapters": {t: (self.store.version(t), {i: {k: v.numpy().tobytes() for k, v in st.items()}
                                                         for i, st in (self.store[t].optimizer or {"state": {}})
                                                         ["state"].items()}) for t in TENANTS},
                "replay": {t: ray.get(self.actor.summary.remote(tenant=t)) for t in TENANTS},
                "scheduler": self.scheduler.state_dict()}


def _drive(run: Run, start: int, stop: int) -> list[str]:
    picked = []
    for i in range(start, stop):
        run.feedback("sk-alice", i)
        if i % 2 == 0:
            run.feedback("sk-bob", i)  # bob writes half as often
        picked.append(run.update())
    return picked


def test_tenants_train_serve_verified_and_resume_exactly_after_a_crash(ray_session, tiny, tmp_path):
    import ray

    from claas_verl.claas.service.hf_tenants import TenantHFBackend

    torch.set_num_threads(1)
    run = Run(tiny, str(tmp_path / "replay.pkl"))
    initial = run.store.version("carol")
    picked = _drive(run, 0, 6)
    assert set(picked) == {"alice", "bob"} and max(run.scheduler.worst_wait.values()) <= run.scheduler.bound

    # serve every tenant's newest version, each verified against the trainer's forward of it
    backend = TenantHFBackend(tiny.student, TENANTS, max_loaded_adapters=1, default_max_tokens=4)
    verified = VerifiedServing(TENANTS, initial)
    ids = probe_ids(backend.tokenizer, 8)
    base = probe_token_logprobs(backend.model, ids)  # no adapter loaded yet
    for tenant in ("alice", "bob"):
        version, digest = run.store.version(tenant)
        run.store.swap_in(tenant, run.model, run.opt)  # the trainer's forward of this version
        trained = probe_token_logprobs(run.model, ids)
        path = tmp_path / f"{tenant}-v{version}"
        run.model.save_pretrained(str(path))
        run.store.swap_out(run.model, run.opt)
        probe = ReloadProbe(ids, lambda s, t=tenant, v=version, d=digest, tr=trained: verified.offer(t, v, d, s, tr))
        assert asyncio.run(backend.load_adapter(path, version=version, probe=probe, tenant=tenant)) == version
        assert verified.served(tenant) == (version, digest)
    # alice's adapter was evicted for bob's (one slot): her next request loads it again, and it is hers
    alice = backend.score_probe(ids, "alice")
    assert backend.cache.counts["reloads"] >= 1
    with torch.no_grad():
        run.store.swap_in("alice", run.model, run.opt)
        assert max(abs(a - b) for a, b in zip(alice, probe_token_logprobs(run.model, ids))) < 1e-5
        run.store.swap_out(run.model, run.opt)
    # carol gave no feedback: her partition is empty, her clock at 0, her adapter the initial one byte for byte
    assert run.store.version("carol") == initial and verified.served("carol") == initial
    assert ray.get(run.actor.summary.remote(tenant="carol")) == {"k": 0, "size": 0, "uids": []}
    assert run.store.version("alice")[0] == ray.get(run.actor.update_count.remote(tenant="alice")) > 0
    assert backend.score_probe(ids, "carol") == pytest.approx(base, abs=1e-6)  # version 0: the base model
    assert max(abs(a - b) for a, b in zip(alice, base)) > 0.1  # alice's training moved her probe

    # checkpoint, then: the uninterrupted run goes on; the other is killed mid-update and resumed from the files
    ckpt = str(tmp_path / "adapters")
    scheduler_state = run.checkpoint(ckpt)
    crashed = Run(tiny, str(tmp_path / "replay.pkl"), ckpt, scheduler_state)
    crashed.feedback("sk-alice", 6)
    with pytest.raises(KeyboardInterrupt):
        crashed.update(crash_after_step=True)
    ray.kill(crashed.actor)
    resumed = Run(tiny, str(tmp_path / "replay.pkl"), ckpt, scheduler_state)
    assert _drive(resumed, 6, 10) == _drive(run, 6, 10)
    assert resumed.state() == run.state()
    assert lora_digest(resumed.store["carol"].adapter) == initial[1]
    for r in (run, resumed):
        ray.kill(r.actor)
