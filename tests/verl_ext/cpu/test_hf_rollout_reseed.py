"""Exact resume of the CPU rollout: the HF server's samples are a function of (seed, replica, global step, prompt,
occurrence of the prompt in the step), never of what the server generated before or of request arrival order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from claas_verl.verl_ext.cpu.hf_rollout import HFRolloutServer

P1, P2 = [5, 6, 7, 8], [9, 10, 11]
PARAMS = {"temperature": 1.0}


def _server(tiny_model_dir, seed=0):
    cfg = SimpleNamespace(
        max_model_len=128, response_length=8, prompt_length=64, seed=seed,
        tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1,
    )
    model_cfg = SimpleNamespace(local_path=str(tiny_model_dir / "student"), trust_remote_code=False, tokenizer=None)
    return HFRolloutServer(cfg, model_cfg)


def _gen(server, prompts):
    return [asyncio.run(server.generate(p, PARAMS, f"r{i}")).token_ids for i, p in enumerate(prompts)]


def test_samples_depend_on_the_step_not_on_history_or_order(tiny_model_dir):
    fresh = _server(tiny_model_dir)
    asyncio.run(fresh.set_global_steps(5))
    a = _gen(fresh, [P1, P2, P1])  # P1 twice: n = 2 responses of one prompt differ by occurrence
    assert a[0] != a[2]

    # a "resumed" server: other steps sampled first, then step 5 announced again (as after loading checkpoint 5)
    resumed = _server(tiny_model_dir)
    asyncio.run(resumed.set_global_steps(2))
    _gen(resumed, [P2, P2, P1])
    asyncio.run(resumed.set_global_steps(5))
    b = _gen(resumed, [P2, P1, P1])  # other arrival order
    assert [b[1], b[0], b[2]] == a

    # the weight sync's step announcement reseeds too; another step samples other responses
    asyncio.run(resumed.receive_weights([]))
    asyncio.run(resumed.finish_weight_update(global_steps=5))
    assert _gen(resumed, [P1, P2, P1]) == a
    asyncio.run(resumed.set_global_steps(6))
    assert _gen(resumed, [P1, P2, P1]) != a
