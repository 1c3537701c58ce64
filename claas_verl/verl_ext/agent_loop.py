"""verl's v1 agent-loop manager, with a stateless agent loop built once per worker instead of once per reply, and a
prompt's replies written to TransferQueue in one put instead of one put per reply.

verl's ``AgentLoopWorker._run_agent_loop`` builds each reply's agent loop with ``hydra.utils.instantiate``. Hydra
first wraps the keyword arguments (config, tokenizer, server client, tools) in OmegaConf nodes: measured 3.4 ms a
reply on this project's CPU machines, against 0.13 ms for the constructor itself. On a small model that is a
third of the agent loop's own cost per reply, paid in the one worker process that prepares every reply of a step
(``docs/verl-couplings.md``, the rollout rows).

``SingleTurnAgentLoop`` keeps nothing of a run on ``self`` (every per-run value is a local of ``run``; its
attributes are the config, tokenizer, server client and chat-template builder that the worker passes to every
instance alike, and the event loop it was built on), so one instance serves every reply of a worker, concurrent
replies included. The instance is kept per event loop: a Ray async actor runs every call on one loop, and a new
loop (a test's ``asyncio.run``) gets a new instance, as the executor calls of ``run`` go through the bound loop.
Any other agent loop, and a registry entry with arguments besides ``_target_``, is built per reply exactly as
verl builds it.

A prompt's replies are also written to TransferQueue together. verl's TQ worker writes every reply with its own
``kv_batch_put`` (three round trips to the TransferQueue controller and storage, about 5 ms of the worker's event
loop on these machines), then the prompt's ``finished`` status once all its ``rollout.n`` sessions settle. Here each
session builds its rows exactly as verl's post-process does (:meth:`ReusingAgentLoopWorkerTQ._trajectory_rows`, the
same keys, fields and tags) and the prompt's last session to settle, succeeded or failed, writes the rows of all of
them in one put, still before the status: a sampler that waits for ``finished`` sees the same rows. Only their
order in the controller changes (grouped by prompt instead of by completion); the MOPD step puts its rows in a
content order first (``mopd.trainer.blocks.canonical_row_order``).

Selected through verl v1's documented hook, ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
(``recipes/mopd/verl/common.yaml``). The replies, rewards and stored rows are verl's: only the construction is
shared and the writes are grouped, so training is bit-identical with or without it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from typing import Any

import hydra
import ray
import torch
import transfer_queue as tq
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.utils.rollout_trace import rollout_trace_attr
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

# Agent loop classes that hold no per-run state on the instance (checked against verl 0.9.1's source; a subclass
# may add state, so the match is exact).
STATELESS_AGENT_LOOPS: tuple[type, ...] = (SingleTurnAgentLoop,)

# verl exposes the TQ worker only as a Ray actor class; the plain class is recovered from Ray's actor metadata
# (as verl_ext.trainer_base does for the TaskRunner).
_AgentLoopWorkerTQ = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__


@dataclasses.dataclass
class PromptRows:
    """The TransferQueue rows of one prompt's sessions, written in one put when the last session settles."""

    sessions: int  # sessions verl starts for the prompt (rollout.n, val_kwargs.n or the prompt's __rollout_n__)
    partition_id: str
    settled: int = 0
    keys: list[str] = dataclasses.field(default_factory=list)
    fields: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, keys: list[str], fields: list[dict[str, Any]], tags: list[dict[str, Any]]) -> None:
        self.keys += keys
        self.fields += fields
        self.tags += tags

    def settle(self) -> bool:
        """Count one settled session; True for the last one, which writes the rows."""
        self.settled += 1
        return self.settled == self.sessions


# The prompt being run by this task and the session tasks verl creates from it (they copy the context).
_PROMPT_ROWS: contextvars.ContextVar[PromptRows | None] = contextvars.ContextVar("claas_prompt_rows", default=None)


async def put_rows(rows: PromptRows) -> None:
    """One ``kv_batch_put`` for rows of one field layout (verl's ``list_of_dict_to_tensordict`` needs it); a
    layout that differs between sessions (an agent loop that sets optional outputs on some replies) is written
    one row at a time, as verl does."""
    if not rows.keys:
        return
    layouts = {tuple(sorted(f)) for f in rows.fields}
    groups = [range(len(rows.keys))] if len(layouts) == 1 else [[i] for i in range(len(rows.keys))]
    for group in groups:
        await tq.async_kv_batch_put(keys=[rows.keys[i] for i in group],
                                    fields=list_of_dict_to_tensordict([rows.fields[i] for i in group]),
                                    tags=[rows.tags[i] for i in group], partition_id=rows.partition_id)


def reusable_agent_loop_class(agent_loop_config: Any) -> type | None:
    """The agent loop class of a registry entry if one instance may serve every reply, else None."""
    if agent_loop_config is None or set(agent_loop_config.keys()) != {"_target_"}:
        return None  # unknown name (verl raises its own error), or arguments that Hydra must pass per build
    cls = hydra.utils.get_class(agent_loop_config["_target_"])
    return cls if cls in STATELESS_AGENT_LOOPS else None


class ReusingAgentLoopWorkerTQ(_AgentLoopWorkerTQ):
    """verl's TQ agent-loop worker; a stateless agent loop is built on its first reply and reused after, and the rows
    of a prompt's sessions are written together by the last one to settle (the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # agent name -> (event loop it was built on, shared agent loop or None if it must be built per reply)
        self._shared_agent_loops: dict[str, tuple[asyncio.AbstractEventLoop, Any]] = {}

    def _shared_agent_loop(self, agent_name: str):
        running = asyncio.get_running_loop()
        built_on, agent_loop = self._shared_agent_loops.get(agent_name, (None, None))
        if built_on is not running:
            config = _agent_loop_registry.get(agent_name)
            agent_loop = None if reusable_agent_loop_class(config) is None else (
                # the same arguments as verl's _run_agent_loop (a source marker in trainer_couplings holds them)
                hydra.utils.instantiate(
                    config=config,
                    trainer_config=DictConfigWrap(config=self.config),
                    server_manager=self.llm_client,
                    tokenizer=self.tokenizer,
                    processor=self.processor,
                    hf_model_type=self.hf_model_type,
                    dataset_cls=self.dataset_cls,
                    data_config=DictConfigWrap(self.config.data),
                    tools=ToolListWrap(self.tools),
                ))
            self._shared_agent_loops[agent_name] = (running, agent_loop)
        return agent_loop

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        config = self.config.actor_rollout_ref.rollout
        validate = trajectory["validate"]
        # the session count verl's _run_prompt uses (it pops the key itself; a source marker holds the expression)
        sessions = int(prompt.get("__rollout_n__", config.n if not validate else config.val_kwargs.n))
        token = _PROMPT_ROWS.set(PromptRows(sessions, "train" if not validate else "val"))
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        finally:
            _PROMPT_ROWS.reset(token)

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                              agent_name: str, trace: bool = True, **kwargs):
        rows = _PROMPT_ROWS.get()
        try:
            return await self._run_session(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                           **kwargs)
        finally:
            if rows is not None and rows.settle():
                await put_rows(rows)

    async def _run_session(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                           agent_name: str, trace: bool, **kwargs):
        agent_loop = self._shared_agent_loop(agent_name)
        if agent_loop is None:
            return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                 **kwargs)
        with rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                rollout_n=trajectory["rollout_n"], validate=trajectory["validate"],
                                name="agent_loop", trace=trace):
            output = await agent_loop.run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    async def _agent_loop_postprocess(self, output, validate, **kwargs) -> None:
        rows = _PROMPT_ROWS.get()
        if rows is None:  # not run through _run_prompt: verl's own per-reply write
            return await super()._agent_loop_postprocess(output, validate, **kwargs)
        rows.add(*await self._trajectory_rows(output, validate, **kwargs))

    async def _trajectory_rows(self, output, validate, **kwargs):
        """verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` up to its put: score the trajectory, then one row per
        agent-loop output, keyed ``{uid}_{session_id}_{index}`` (source markers in trainer_couplings hold the
        fields and tags verl writes)."""
        uid, session_id = kwargs["uid"], kwargs["session_id"]
        outputs = output if isinstance(output, list) else [output]
        if not outputs:
            await super()._agent_loop_postprocess(outputs, validate, **kwargs)  # verl only logs an empty output
            return [], [], []
        await self._compute_score(outputs, kwargs=kwargs)
        final = outputs[-1]
        await self._compute_teacher_logprobs(final, prompt_ids=final.prompt_ids, response_ids=final.response_ids,
                                             validate=validate, sample_kwargs=kwargs)
        if final.reward_score is not None:
            for earlier in outputs[:-1]:
                earlier.reward_score = final.reward_score
                earlier.extra_fields["reward_extra_info"] = final.extra_fields["reward_extra_info"]
        keys, fields, tags = [], [], []
        for i, out in enumerate(outputs):
            input_ids = torch.cat([torch.tensor(out.prompt_ids, dtype=torch.int64),
                                   torch.tensor(out.response_ids, dtype=torch.int64)], dim=0)
            attention_mask = torch.ones_like(input_ids, dtype=torch.int64)
            multi_modal_inputs = self._compute_multi_modal_inputs(out, input_ids)
            position_ids = self._compute_position_ids(input_ids.unsqueeze(0), attention_mask.unsqueeze(0),
                                                      multi_modal_inputs).squeeze(0)
            field = out.as_dict()
            field.update(kwargs)
            field.pop("multi_modal_data", None)  # raw images/videos are not stored
            field["loss_mask"] = field["response_mask"]
            field["input_ids"] = input_ids
            field["position_ids"] = position_ids
            field["multi_modal_inputs"] = multi_modal_inputs
            prompt_len, response_len = field["prompts"].size(0), field["responses"].size(0)
            keys.append(f"{uid}_{session_id}_{i}")
            fields.append(field)
            tags.append({"status": "success", "prompt_len": prompt_len, "response_len": response_len,
                         "seq_len": prompt_len + response_len, "global_steps": kwargs["global_steps"],
                         "min_global_steps": field["extra_fields"].get("min_global_steps"),
                         "max_global_steps": field["extra_fields"].get("max_global_steps")})
        return keys, fields, tags


class ReusingAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's TQ agent-loop manager whose workers are :class:`ReusingAgentLoopWorkerTQ`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(ReusingAgentLoopWorkerTQ)
