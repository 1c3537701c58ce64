"""The HF rollout server in-process (no Ray): log-probs of the sampled distribution, weight sync, LoRA."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from claas_verl.verl_ext.cpu.hf_rollout import HFRolloutServer, hf_max_batch_size


def _server(model_dir, max_batch_size=None):
    cfg = SimpleNamespace(
        max_model_len=128, response_length=6, prompt_length=64, seed=0,
        engine_kwargs={} if max_batch_size is None else {"hf": {"max_batch_size": max_batch_size}},
        tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1,
    )
    model_cfg = SimpleNamespace(local_path=str(model_dir / "student"), trust_remote_code=False, tokenizer=None)
    return HFRolloutServer(cfg, model_cfg)


def test_generate_update_weights_and_version(tiny_model_dir):
    server = _server(tiny_model_dir)
    out = asyncio.run(server.generate([1, 2, 3], {"temperature": 1.0, "logprobs": True}, "r0"))
    assert 1 <= len(out.token_ids) <= 6 and len(out.log_probs) == len(out.token_ids)
    assert all(lp <= 0.0 for lp in out.log_probs)
    assert out.extra_fields["policy_version"] == 0

    state = {k: torch.zeros_like(v) for k, v in server.model.state_dict().items() if k.endswith("mlp.down_proj.weight")}
    asyncio.run(server.receive_weights(list(state.items())))
    assert asyncio.run(server.finish_weight_update(global_steps=3)) == 1
    served = server.get_named_parameters()
    assert all(torch.count_nonzero(served[k]) == 0 for k in state)
    assert server.global_steps == 3

    with pytest.raises(KeyError, match="no_such.weight"):
        asyncio.run(server.receive_weights([("no_such.weight", torch.zeros(1))]))
        asyncio.run(server.finish_weight_update())


def _adapter_push(tiny_model_dir, peft_config):
    """Adapter tensors named as peft's ``get_peft_model_state_dict`` names them (what verl's FSDP engine sends)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    trainer_side = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir / "student"), peft_config)
    return {k: torch.full_like(v, 0.05) for k, v in get_peft_model_state_dict(trainer_side).items()}


@pytest.mark.parametrize("wire", ["dict", "LoraConfig"])
def test_lora_adapter_changes_the_served_policy(tiny_model_dir, wire):
    from peft import LoraConfig

    server = _server(tiny_model_dir)
    before = server.get_named_parameters()
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    lora = _adapter_push(tiny_model_dir, peft_config)
    # verl 0.9.1's FSDP engine ships `peft_config.to_dict()` (get_per_tensor_param); in-process callers the object.
    sent = peft_config.to_dict() if wire == "dict" else peft_config
    asyncio.run(server.receive_weights(list(lora.items())))
    assert asyncio.run(server.finish_weight_update(peft_config=sent, base_sync_done=True)) == 1
    after = server.get_named_parameters()
    changed = [k for k in before if "q_proj.weight" in k and not torch.allclose(before[k], after[k])]
    assert changed, "LoRA tensors were dropped: the served q_proj weights did not change"
    assert not [k for k in before if "k_proj.weight" in k and not torch.allclose(before[k], after[k])]
    last = server.get_last_update()
    assert last["kind"] == "lora" and last["names"] == sorted(lora) and last["version"] == 1
    assert all("lora_" in n for n in last["names"])

    # A second adapter-only push (the steady state after the first sync) replaces the adapter in place.
    lora2 = {k: torch.full_like(v, 0.1) for k, v in lora.items()}  # B·A scales by 4
    asyncio.run(server.receive_weights(list(lora2.items())))
    assert asyncio.run(server.finish_weight_update(peft_config=sent, base_sync_done=True)) == 2
    after2 = server.get_named_parameters()
    assert any(not torch.allclose(after[k], after2[k]) for k in changed)


def test_peft_config_dict_without_type_is_rejected():
    from claas_verl.verl_ext.cpu.hf_rollout import as_peft_config

    with pytest.raises(ValueError, match="peft_type"):
        as_peft_config({"r": 2})


def _generate_concurrently(server, prompts, params, max_tokens):
    async def run():
        calls = [server.generate(p, {**params, "max_tokens": n}, f"r{i}")
                 for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


@pytest.mark.parametrize("params", [{"temperature": 1.0, "logprobs": True}, {"temperature": 0.0, "logprobs": True}])
def test_concurrent_requests_decode_as_one_batch_with_each_alone_samples(tiny_model_dir, params):
    # prompts of unequal length (left padding), one repeated (two occurrences draw two streams); replies of
    # unequal length (rows leave the batch, and its KV cache, at their stop token or max_tokens)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [5, 6, 7, 8, 9, 10, 11], [14, 15, 16, 17]]
    max_tokens = [6, 2, 5, 3]
    batched, alone = _server(tiny_model_dir, max_batch_size=64), _server(tiny_model_dir)
    for server in (batched, alone):
        asyncio.run(server.set_global_steps(4))
    got = _generate_concurrently(batched, prompts, params, max_tokens)
    ref = _generate_concurrently(alone, prompts, params, max_tokens)
    # alone: the repeated prompt's two requests decode together, row by row (each with its lone bits)
    assert batched.get_batch_sizes() == [4] and alone.get_batch_sizes() == [2, 1, 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert len({len(o.token_ids) for o in ref}) > 1
    for o, r in zip(got, ref):
        assert o.log_probs == pytest.approx(r.log_probs, abs=1e-5)


def test_a_failing_batch_fails_each_caller_and_the_server_keeps_serving(tiny_model_dir):
    server = _server(tiny_model_dir, max_batch_size=8)
    calls = []
    decode = server._decode_batch

    def fail_once(requests, generators):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("decode failed")
        return decode(requests, generators)

    server._decode_batch = fail_once
    outs = asyncio.run(_gather_settled(server, [[5, 6], [7, 8, 9]]))
    assert all(isinstance(o, RuntimeError) for o in outs)
    assert len(asyncio.run(server.generate([5, 6], {"temperature": 1.0}, "again")).token_ids) >= 1


async def _gather_settled(server, prompts):
    return await asyncio.gather(
        *[server.generate(p, {"temperature": 1.0}, f"r{i}") for i, p in enumerate(prompts)], return_exceptions=True
    )


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_batch_size_setting_is_validated_naming_the_key(value):
    cfg = SimpleNamespace(engine_kwargs={"hf": {"max_batch_size": value}})
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs\.hf\.max_batch_size"):
        hf_max_batch_size(cfg)
    assert hf_max_batch_size(SimpleNamespace()) == 1 and hf_max_batch_size(SimpleNamespace(engine_kwargs={})) == 1


def test_batch_history_is_bounded_on_a_long_lived_server(tiny_model_dir, monkeypatch):
    from claas_verl.verl_ext.cpu import hf_rollout

    monkeypatch.setattr(hf_rollout, "_BATCH_HISTORY", 2)
    server = _server(tiny_model_dir)
    for i in range(3):
        asyncio.run(server.generate([5, 6, 7], {"temperature": 1.0, "max_tokens": 1}, f"r{i}"))
    assert server.get_batch_sizes() == [1, 1]


def _count_prefills(server):
    prompts = []
    prefill = server._prefill

    def counting(prompt_ids):
        prompts.append(list(prompt_ids))
        return prefill(prompt_ids)

    server._prefill = counting
    return prompts


async def _one_at_a_time(server, prompts, params):
    return [await server.generate(p, params, f"s{i}") for i, p in enumerate(prompts)]


@pytest.mark.parametrize("announced", [True, False])
def test_replies_of_one_prompt_share_its_prefill_and_are_the_replies_each_gets_alone(tiny_model_dir, announced):
    """verl's rollout.n replies of a prompt arrive together: decoded alone (max_batch_size 1), they follow the
    first one out of the queue, reuse its prefill and decode as one batch of row-by-row products, and every reply
    is bit for bit the one a request sent on its own gets. Before the first step announcement every request draws
    from one generator: nothing is reordered or batched."""
    p, q = [5, 6, 7, 8, 9, 10, 11], [12, 13, 14]
    prompts = [p, q, p, p, q]
    params = {"temperature": 1.0, "logprobs": True, "max_tokens": 6}
    queued, sequential = _server(tiny_model_dir), _server(tiny_model_dir)
    if announced:
        for server in (queued, sequential):
            asyncio.run(server.set_global_steps(2))
    prefills = _count_prefills(queued)
    got = _generate_concurrently(queued, prompts, params, [6] * len(prompts))
    ref = asyncio.run(_one_at_a_time(sequential, prompts, params))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.log_probs for o in got] == [o.log_probs for o in ref]  # exactly, not approximately
    assert prefills == ([p, q] if announced else prompts)
    assert queued.get_batch_sizes() == ([3, 2] if announced else [1] * len(prompts))
    assert len({tuple(o.token_ids) for o in ref}) > 1  # the replies differ: sampled, not copied


def test_a_shared_prefill_serves_the_requests_of_its_own_prompt_only(tiny_model_dir):
    server = _server(tiny_model_dir)
    request, other = server._request([5, 6, 7], {"temperature": 1.0}), server._request([5, 6], {"temperature": 1.0})
    with pytest.raises(ValueError, match="of its own prompt only"):
        server._decode_batch([request, other], [torch.Generator(), torch.Generator()],
                             prefill=server._prefill([5, 6, 7]))


def _lora_server(tiny_model_dir):
    from peft import LoraConfig

    server = _server(tiny_model_dir)
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    asyncio.run(server.receive_weights(list(_adapter_push(tiny_model_dir, peft_config).items())))
    asyncio.run(server.finish_weight_update(peft_config=peft_config, base_sync_done=True, global_steps=3))
    return server


@pytest.mark.parametrize("adapter", [False, True])
def test_siblings_decoded_together_match_their_lone_replies_exactly(tiny_model_dir, adapter):
    """Four replies of one prompt of unequal lengths (rows leave the batch), with and without a LoRA adapter (its
    layers join the row-by-row products, and the check runs again once peft wraps the model)."""
    p = [5, 6, 7, 8, 9, 10, 11]
    params = {"temperature": 1.0, "logprobs": True}
    make = (lambda: _lora_server(tiny_model_dir)) if adapter else (lambda: _server(tiny_model_dir))
    together, sequential = make(), make()
    for server in (together, sequential):
        asyncio.run(server.set_global_steps(3))
    lengths = [6, 2, 6, 4]
    got = _generate_concurrently(together, [p] * 4, params, lengths)
    ref = [asyncio.run(sequential.generate(p, {**params, "max_tokens": n}, f"s{i}")) for i, n in enumerate(lengths)]
    assert together.get_batch_sizes() == [4] and sequential.get_batch_sizes() == [1, 1, 1, 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.log_probs for o in got] == [o.log_probs for o in ref]  # exactly
    assert len({len(o.token_ids) for o in got}) > 1


def test_siblings_decode_one_after_another_where_batching_would_change_the_bits(tiny_model_dir, monkeypatch):
    from claas_verl.verl_ext.cpu import hf_rollout

    checked = []
    monkeypatch.setattr(hf_rollout, "rowwise_decode_matches", lambda *args: checked.append(1) or False)
    server = _server(tiny_model_dir)
    asyncio.run(server.set_global_steps(2))
    outs = _generate_concurrently(server, [[5, 6, 7]] * 3 + [[8, 9]] * 2, {"temperature": 1.0}, [4] * 5)
    assert all(1 <= len(o.token_ids) <= 4 for o in outs)
    assert server.get_batch_sizes() == [1] * 5 and checked == [1]  # checked once, then remembered


def test_the_check_runs_again_once_an_adapter_wraps_the_model(tiny_model_dir, monkeypatch):
    from peft import LoraConfig

    from claas_verl.verl_ext.cpu import hf_rollout

    calls = []
    real = hf_rollout.rowwise_decode_matches
    monkeypatch.setattr(hf_rollout, "rowwise_decode_matches", lambda *args: calls.append(1) or real(*args))
    server = _server(tiny_model_dir)
    asyncio.run(server.set_global_steps(2))
    _generate_concurrently(server, [[5, 6, 7]] * 2, {"temperature": 1.0}, [3, 3])
    _generate_concurrently(server, [[8, 9]] * 2, {"temperature": 1.0}, [3, 3])
    assert len(calls) == 1
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    asyncio.run(server.receive_weights(list(_adapter_push(tiny_model_dir, peft_config).items())))
    asyncio.run(server.finish_weight_update(peft_config=peft_config, base_sync_done=True, global_steps=3))
    _generate_concurrently(server, [[5, 6, 7]] * 2, {"temperature": 1.0}, [3, 3])
    assert len(calls) == 2 and server.get_batch_sizes() == [2, 2, 2]
