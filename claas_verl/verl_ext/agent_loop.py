"""verl's v1 agent-loop manager, with a stateless agent loop built once per worker instead of once per reply.

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

Selected through verl v1's documented hook, ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
(``recipes/mopd/verl/common.yaml``). The replies, rewards and TransferQueue writes are verl's: only the
construction is shared, so training is bit-identical with or without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hydra
import ray
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.utils.rollout_trace import rollout_trace_attr

# Agent loop classes that hold no per-run state on the instance (checked against verl 0.9.1's source; a subclass
# may add state, so the match is exact).
STATELESS_AGENT_LOOPS: tuple[type, ...] = (SingleTurnAgentLoop,)

# verl exposes the TQ worker only as a Ray actor class; the plain class is recovered from Ray's actor metadata
# (as verl_ext.trainer_base does for the TaskRunner).
_AgentLoopWorkerTQ = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__


def reusable_agent_loop_class(agent_loop_config: Any) -> type | None:
    """The agent loop class of a registry entry if one instance may serve every reply, else None."""
    if agent_loop_config is None or set(agent_loop_config.keys()) != {"_target_"}:
        return None  # unknown name (verl raises its own error), or arguments that Hydra must pass per build
    cls = hydra.utils.get_class(agent_loop_config["_target_"])
    return cls if cls in STATELESS_AGENT_LOOPS else None


class ReusingAgentLoopWorkerTQ(_AgentLoopWorkerTQ):
    """verl's TQ agent-loop worker; a stateless agent loop is built on its first reply and reused after."""

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

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                              agent_name: str, trace: bool = True, **kwargs):
        agent_loop = self._shared_agent_loop(agent_name)
        if agent_loop is None:
            return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                 **kwargs)
        with rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                rollout_n=trajectory["rollout_n"], validate=trajectory["validate"],
                                name="agent_loop", trace=trace):
            output = await agent_loop.run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)


class ReusingAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's TQ agent-loop manager whose workers are :class:`ReusingAgentLoopWorkerTQ`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(ReusingAgentLoopWorkerTQ)
