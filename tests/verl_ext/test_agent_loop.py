"""verl_ext.agent_loop: the single-turn agent loop is built once per worker and gives the replies verl's per-reply
build gives; every other agent loop is left to verl. A prompt's rows reach TransferQueue in one put, the very rows
verl's per-reply puts write, before the prompt's status. The whole path (Ray workers, TransferQueue, the `hf` server)
runs in every MOPD trainer test, whose recipes select this manager."""

from __future__ import annotations

import asyncio
import inspect
import re
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from claas_verl.paths import recipes_dir
from claas_verl.tiny import gym
from claas_verl.verl_ext import agent_loop as al

SINGLE_TURN = "single_turn_agent"


class StatefulLoop(SingleTurnAgentLoop):
    """A subclass may keep state of a run: never shared."""


def test_only_an_exact_stateless_loop_without_arguments_is_shared():
    assert al.reusable_agent_loop_class(_agent_loop_registry[SINGLE_TURN]) is SingleTurnAgentLoop
    target = {"_target_": f"{SingleTurnAgentLoop.__module__}.SingleTurnAgentLoop"}
    assert al.reusable_agent_loop_class(OmegaConf.create(target)) is SingleTurnAgentLoop  # a YAML-registered entry
    # arguments Hydra passes per build, an unknown name, a loop with per-run state, a subclass (may add state)
    assert al.reusable_agent_loop_class({**target, "max_turns": 3}) is None
    assert al.reusable_agent_loop_class(None) is None
    assert al.reusable_agent_loop_class(_agent_loop_registry["tool_agent"]) is None
    assert al.reusable_agent_loop_class({"_target_": f"{StatefulLoop.__module__}.StatefulLoop"}) is None


def test_verls_single_turn_loop_still_keeps_nothing_of_a_run_on_the_instance():
    """What sharing one instance rests on: ``run`` (and what it calls on ``self``) assigns no attribute."""
    for name in ("run", "ct_build_initial_tokens", "ct_merge_assistant_token", "process_multi_modal_info"):
        src = inspect.getsource(getattr(SingleTurnAgentLoop, name))
        assert not re.search(r"\bself\.\w+(\.\w+)*\s*(=|\+=)(?!=)", src), f"SingleTurnAgentLoop.{name} sets state"


class _EchoServer:
    """Stands in for the LLM server client: a reply that depends on the prompt, after a yield to the event loop
    so that replies interleave (the server itself runs in every MOPD trainer test)."""

    def __init__(self):
        self.calls = 0

    async def generate(self, *, prompt_ids, **_):
        self.calls += 1
        await asyncio.sleep(0)
        return TokenOutput(token_ids=[5 + (prompt_ids[-2] % 200), 6 + len(prompt_ids) % 50],
                           log_probs=[-0.5, -0.25])


def _worker(cls, probe: bool = True):
    """A worker with the attributes verl's ``__init__`` sets and the agent loop reads (no Ray, no TransferQueue);
    with ``probe`` its post-processing returns the agent loop's output instead of writing it to TransferQueue."""
    class Probe(cls):
        async def _agent_loop_postprocess(self, output, validate, **kwargs):
            return output

    worker_cls = Probe if probe else cls
    worker = worker_cls.__new__(worker_cls)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 64, "response_length": 8}},
                               "data": {}})
    worker.config, worker.llm_client, worker.tokenizer = config, _EchoServer(), gym.byte_tokenizer()
    worker.processor, worker.hf_model_type, worker.dataset_cls, worker.tools = None, "qwen2", None, []
    worker._shared_agent_loops = {}
    return worker


async def _replies(worker, prompts):
    traj = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False}
    return await asyncio.gather(*[
        worker._run_agent_loop({"temperature": 1.0}, traj, agent_name=SINGLE_TURN, trace=False,
                               raw_prompt=[{"role": "user", "content": p}], priority=i)
        for i, p in enumerate(prompts)])


def test_one_shared_loop_gives_the_replies_of_verls_loop_per_reply(monkeypatch):
    prompts = ["Spell backward: cat", "Reverse: it, or, my", "What is 3 + 4?", "Spell backward: cat"]
    builds = []
    original = SingleTurnAgentLoop.__init__

    def counting_init(self, *a, **k):
        builds.append(self)
        original(self, *a, **k)

    monkeypatch.setattr(SingleTurnAgentLoop, "__init__", counting_init)
    verls = asyncio.run(_replies(_worker(al._AgentLoopWorkerTQ), prompts))
    assert len(builds) == len(prompts)  # verl: one build per reply

    builds.clear()
    worker = _worker(al.ReusingAgentLoopWorkerTQ)

    async def two_steps():  # a Ray async actor serves every step on one event loop
        return await _replies(worker, prompts) + await _replies(worker, prompts[:2])

    shared = asyncio.run(two_steps())
    assert len(builds) == 1 and worker._shared_agent_loops[SINGLE_TURN][1] is builds[0]
    assert worker.llm_client.calls == len(prompts) + 2
    # the instance holds the event loop it was built on (verl's run sends tokenization through it): a new event
    # loop gets a new instance
    again = asyncio.run(_replies(worker, prompts[:2]))
    assert len(builds) == 2 and worker._shared_agent_loops[SINGLE_TURN][1] is builds[1]
    for ours, theirs in zip(shared + again, verls + verls[:2] + verls[:2], strict=True):
        assert (ours.prompt_ids, ours.response_ids, ours.response_mask, ours.response_logprobs) == (
            theirs.prompt_ids, theirs.response_ids, theirs.response_mask, theirs.response_logprobs)
    assert shared[0].prompt_ids != shared[1].prompt_ids  # the replies did depend on their own prompts


def test_any_other_agent_loop_is_left_to_verl(monkeypatch):
    worker = _worker(al.ReusingAgentLoopWorkerTQ)
    seen = []

    async def verls_path(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        seen.append(agent_name)
        return agent_name

    monkeypatch.setattr(al._AgentLoopWorkerTQ, "_run_agent_loop", verls_path)
    traj = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False}
    assert asyncio.run(worker._run_agent_loop({}, traj, agent_name="tool_agent")) == "tool_agent"
    assert seen == ["tool_agent"] and worker._shared_agent_loops["tool_agent"][1] is None


def test_the_mopd_recipes_select_the_manager_and_verl_can_load_it():
    from verl.utils.import_utils import load_class_from_fqn

    cfg = OmegaConf.load(recipes_dir() / "mopd" / "verl" / "common.yaml")
    fqn = cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class
    assert load_class_from_fqn(fqn, "AgentLoopManager") is al.ReusingAgentLoopManagerTQ


def test_the_manager_hands_verl_a_ray_actor_class_of_the_sharing_worker():
    manager = al.ReusingAgentLoopManagerTQ(config=SimpleNamespace(actor_rollout_ref=SimpleNamespace(
        rollout=None, model=None)), llm_client=None)
    actor_class = manager.agent_loop_workers_class
    assert actor_class.__ray_metadata__.modified_class.__ray_actor_class__ is al.ReusingAgentLoopWorkerTQ


# ---- a prompt's replies written to TransferQueue in one put


def _tq_worker(cls, n: int):
    """A TQ worker (no Ray) whose TransferQueue calls the test records; no reward workers, no teachers."""
    worker = _worker(cls, probe=False)  # the worker's own post-processing
    worker.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 64, "response_length": 8, "n": n, "val_kwargs": {"n": 1}}}, "data": {}})
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    return worker


def _record_tq(monkeypatch):
    import transfer_queue as tq

    calls = []

    async def kv_put(*, key, partition_id, tag, **_):
        calls.append(("status", key, partition_id, tag["status"]))

    async def kv_batch_put(*, keys, partition_id, fields, tags):
        calls.append(("rows", list(keys), partition_id, fields, list(tags)))

    monkeypatch.setattr(tq, "async_kv_put", kv_put)
    monkeypatch.setattr(tq, "async_kv_batch_put", kv_batch_put)
    return calls


def _rows(calls) -> dict:
    """{key: (tag, {field: value})} over every recorded put (the per-reply timing metrics by name only)."""
    from tensordict import NonTensorStack

    out = {}
    for call in (c for c in calls if c[0] == "rows"):
        _, keys, _, fields, tags = call
        for i, key in enumerate(keys):
            row = {}
            for name in fields.keys():
                value = fields.get(name)
                if isinstance(value, NonTensorStack):
                    row[name] = value.tolist()[i]
                else:
                    row[name] = (value.unbind(0) if value.is_nested else value)[i].tolist()
            row["metrics"] = sorted(row["metrics"])  # timings: which are measured, not their values
            out[key] = (tags[i], row)
    return out


def _prompt(uid: str, text: str) -> dict:
    return {"uid": uid, "raw_prompt": [{"role": "user", "content": text}], "agent_name": SINGLE_TURN,
            "global_steps": 3, "index": 7}


TRAJECTORY = {"step": 3, "sample_index": 0, "rollout_n": 0, "validate": False}


def test_a_prompts_replies_are_written_in_one_put_with_verls_rows_before_its_status(monkeypatch):
    calls = _record_tq(monkeypatch)
    asyncio.run(_tq_worker(al._AgentLoopWorkerTQ, 3)._run_prompt(_prompt("u1", "Spell backward: cat"), {},
                                                                  TRAJECTORY))
    verls, verl_calls = _rows(calls), list(calls)
    assert [c[0] for c in verl_calls] == ["status", "rows", "rows", "rows", "status"]  # one put per reply

    calls.clear()
    asyncio.run(_tq_worker(al.ReusingAgentLoopWorkerTQ, 3)._run_prompt(_prompt("u1", "Spell backward: cat"), {},
                                                                       TRAJECTORY))
    assert [c[0] for c in calls] == ["status", "rows", "status"]  # the rows before the prompt's status
    assert sorted(calls[1][1]) == ["u1_0_0", "u1_1_0", "u1_2_0"] and calls[1][2] == "train"  # settle order
    assert calls[-1][1:] == ("u1", "train", "finished")
    ours = _rows(calls)
    assert ours.keys() == verls.keys()
    for key in verls:
        assert ours[key] == verls[key], key  # every tag and field value of every row
    assert ours["u1_0_0"][1]["session_id"] == 0 and ours["u1_2_0"][1]["session_id"] == 2


def test_a_failed_session_still_lets_its_siblings_rows_be_written_once(monkeypatch):
    calls = _record_tq(monkeypatch)
    worker = _tq_worker(al.ReusingAgentLoopWorkerTQ, 3)
    generate = worker.llm_client.generate

    async def second_fails(**kw):
        if worker.llm_client.calls == 1:
            worker.llm_client.calls += 1
            raise RuntimeError("server lost")
        return await generate(**kw)

    worker.llm_client.generate = second_fails
    asyncio.run(worker._run_prompt(_prompt("u2", "Reverse: it, or, my"), {}, TRAJECTORY))
    assert [c[0] for c in calls] == ["status", "rows", "status"]
    assert len(calls[1][1]) == 2 and calls[-1][3] == "failure"  # verl's status for a group with a failed session


def test_sessions_outside_a_prompt_run_write_as_verl_does(monkeypatch):
    """A caller that runs a session without ``_run_prompt`` (no prompt to group by) gets verl's per-reply put."""
    calls = _record_tq(monkeypatch)
    worker = _tq_worker(al.ReusingAgentLoopWorkerTQ, 3)
    asyncio.run(worker._run_agent_loop({}, TRAJECTORY, trace=False, session_id=0, **_prompt("u3", "What is 3 + 4?")))
    assert [(c[0], c[1]) for c in calls] == [("rows", ["u3_0_0"])]


def test_rows_of_different_layouts_are_written_one_at_a_time(monkeypatch):
    calls = _record_tq(monkeypatch)
    rows = al.PromptRows(sessions=2, partition_id="train")
    rows.add(["a_0_0"], [{"x": torch.tensor([1, 2])}], [{"status": "success"}])
    rows.add(["a_1_0"], [{"x": torch.tensor([3]), "rollout_log_probs": torch.tensor([-1.0])}],
             [{"status": "success"}])
    asyncio.run(al.put_rows(rows))
    assert [c[1] for c in calls] == [["a_0_0"], ["a_1_0"]]
