"""Rollout producers: run scenarios on the rollout servers, grade them, feed the replay-buffer actor.

One :class:`RolloutProducer` drives a stream of scenarios (docs/math.md §A.1.3, A.1.5 ``entry_unit="step"``):
for every scenario, turn by turn (at most T), it renders the chat context, asks the rollout servers
for a reply with the *currently served* policy, grades the reply with the scenario's verifier and
turns the step into a :class:`~claas_verl.claas.replay.ReplayEntry` with

* ``behaviour_logprob`` = Σ of the served per-token log-probs of the sampled reply (docs/math.md §A.1.1);
* ``P`` = the policy version the server reported for that request (``extra_fields["global_steps"]``,
  the update count of the weights that served it; the trainer pushes weights with its step count);
* ``reward`` from the verifier; ``None`` (grader crash/timeout) is counted and never sent (docs/math.md §A.1.4).

Requests that feed training always sample with τ = 1, top-p = 1, top-k off (docs/math.md §0): the behaviour
log-prob must be that of the distribution actually sampled.

Everything runs on one asyncio loop in a background thread of the trainer process
(:class:`BackgroundLoop`), so rollouts continue while the trainer thread blocks in a training step;
the only shared state with the trainer is the EMA reward statistics, guarded by a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from claas_verl.claas.envs.base import Grade, Scenario
from claas_verl.claas.replay.entry import ReplayEntry, ScenarioEntry
from claas_verl.claas.replay.store import send_format
from claas_verl.claas.service.teacher import TEACHER_IDS_KEY

# (request_id, prompt_ids, sampling_params) -> object with token_ids, log_probs, extra_fields (verl's TokenOutput)
GenerateFn = Callable[[str, list, dict], Awaitable[Any]]

TRAIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


class BackgroundLoop:
    """An asyncio event loop running in a daemon thread; ``submit`` returns a ``concurrent.futures.Future``."""

    def __init__(self, name: str = "claas-producer"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


@dataclass
class StepRecord:
    """One generated and graded step (before it becomes a replay entry)."""

    scenario_index: int
    step_idx: int
    prompt_ids: list
    response_ids: list
    behaviour_logprob: float
    version: int | None
    grade: Grade
    latency_s: float
    teacher_prompt_ids: list | None = None  # SDPO teacher context x' (feedback re-prompt), None: no signal


@dataclass
class ProducerStats:
    """Counters of one producer (cumulative over splits; restored at a resume). The commit counters (scenarios,
    steps, entries, rewards, drops) are exact at a checkpoint; the generation counters (tokens, aborts, retries,
    prompt_too_long, empty replies) also include work on the scenarios in flight then, which a resume re-generates."""

    scenarios: int = 0
    steps: int = 0
    none_rewards: int = 0
    entries_sent: int = 0
    entries_accepted: int = 0
    reward_sum: float = 0.0
    generated_tokens: int = 0
    generate_s: float = 0.0
    prompt_too_long: int = 0
    rollout_wall_s: float = 0.0  # wall time spent with a split's rollouts in flight
    aborted: int = 0  # generations the server aborted (e.g. cut by a weight update); the turn is re-generated
    retries: int = 0  # generate / grade calls retried after an error or an abort
    empty_replies: int = 0  # the server returned no token (not an abort): the scenario ends there, counted
    unconcatenable: int = 0  # scenario mode: turns the template would not let extend the previous tokens
    ema_skipped: int = 0  # accepted rewards of partially accepted batches the EMA did not see (see _produce_one)
    dropped_scenarios: int = 0  # scenarios dropped after max_retries failed attempts of one call
    last_drop_cause: str | None = None
    versions: list = field(default_factory=list)

    def as_dict(self) -> dict:
        graded = self.steps - self.none_rewards
        return {
            "scenarios": self.scenarios,
            "steps": self.steps,
            "none_rewards": self.none_rewards,
            "entries_sent": self.entries_sent,
            "entries_accepted": self.entries_accepted,
            "mean_reward": self.reward_sum / graded if graded else float("nan"),
            "generated_tokens": self.generated_tokens,
            "generate_s": self.generate_s,
            "prompt_too_long": self.prompt_too_long,
            "rollout_wall_s": self.rollout_wall_s,
            "tokens_per_s": self.generated_tokens / self.rollout_wall_s if self.rollout_wall_s else float("nan"),
            "aborted": self.aborted,
            "retries": self.retries,
            "empty_replies": self.empty_replies,
            "unconcatenable": self.unconcatenable,
            "ema_skipped": self.ema_skipped,
            "dropped_scenarios": self.dropped_scenarios,
            "last_drop_cause": self.last_drop_cause,
        }


class ScenarioDropped(RuntimeError):
    """One call of a scenario failed ``max_retries + 1`` times: the scenario is dropped (counted), the run goes on."""


_ABORTED = ("abort", "aborted")


class ChatRenderer:
    """Chat messages -> prompt token ids with the policy's chat template (generation prompt appended)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, messages: list[dict]) -> tuple[list[int], bool]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        # A template that opens <think> in the generation prompt makes an unclosed block possible (reward 0).
        return list(ids), text.rstrip().endswith("<think>")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def extend(self, prev_text: str, prev_ids: list[int], reply_ids: Sequence[int],
               messages: list[dict]) -> tuple[list[int], str, bool] | None:
        """Next turn's prompt as ``prev_ids + reply_ids + observation ids`` (token-level multi-turn, as verl's agent
        loop builds it), so a scenario is one token sequence; ``(ids, text, think_open)``, or None when the
        template re-renders the earlier turns differently (then the turns cannot be concatenated)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        sampled = prev_text + self.tokenizer.decode(list(reply_ids), skip_special_tokens=False)
        if not text.startswith(sampled):
            return None
        obs = self.tokenizer.encode(text[len(sampled):], add_special_tokens=False)
        return list(prev_ids) + [int(t) for t in reply_ids] + list(obs), text, text.rstrip().endswith("<think>")


class RolloutProducer:
    """Generates, grades and inserts per-step entries; also evaluates pass rates without inserting.

    Args:
        generate: verl's ``LLMServerClient.generate``-like coroutine (see :data:`GenerateFn`).
        renderer: :class:`ChatRenderer` over the policy tokenizer.
        replay: the ``ReplayBufferActor`` handle (``add.remote(entries)``), or None to insert nothing (ICL).
        max_new_tokens: per-turn generation budget.
        max_concurrent: scenarios in flight at once.
        max_prompt_tokens: a turn whose context exceeds it ends its scenario (counted in ``prompt_too_long``).
        ema_stats / ema_lock: the live REINFORCE++ EMA statistics, updated with every inserted reward.
        icl_memory: an ``ICLFeedbackMemory``: failed steps' feedback goes into later system prompts (ICL baseline).
        sdpo_reprompt: SDPO only: ``{"reprompt_success": bool}``; each graded step also gets the token ids of its
            teacher context x' (the last user turn re-prompted with the verifier feedback, docs/math.md §A.3.3), stored
            in the entry's ``metadata["teacher_prompt_ids"]``.
        max_retries: a generate call that raises or comes back aborted, or a grading call that raises, is retried
            this many times; then the scenario is dropped and counted (``dropped_scenarios``).
        entry_unit: ``"step"`` (one entry per step) or ``"scenario"`` (one :class:`ScenarioEntry` per scenario,
            reward ``min`` over the steps, dropped when any step reward is None; docs/math.md §A.1.5). In scenario mode
            each turn's prompt extends the previous prompt + sampled reply token by token, so the scenario is one
            sequence the trainer can replay exactly.
    """

    def __init__(self, generate: GenerateFn, renderer: ChatRenderer, replay: Any, *, max_new_tokens: int,
                 max_concurrent: int = 4, max_prompt_tokens: int | None = None, ema_stats=None,
                 ema_lock: threading.Lock | None = None, icl_memory=None, sdpo_reprompt: dict | None = None,
                 max_retries: int = 2, entry_unit: str = "step"):
        self.generate = generate
        self.renderer = renderer
        self.replay = replay
        self.max_new_tokens = int(max_new_tokens)
        self.max_concurrent = int(max_concurrent)
        self.max_prompt_tokens = max_prompt_tokens
        self.ema_stats = ema_stats
        self.ema_lock = ema_lock or threading.Lock()
        self.icl_memory = icl_memory
        self.sdpo_reprompt = sdpo_reprompt
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = int(max_retries)
        if entry_unit not in ("step", "scenario"):
            raise ValueError(f"entry_unit must be 'step' or 'scenario', got {entry_unit!r}")
        if entry_unit == "scenario" and (sdpo_reprompt is not None or icl_memory is not None):
            raise ValueError("entry_unit='scenario' is for reinforce_pp / ppo (SDPO and ICL work per step)")
        self.entry_unit = entry_unit
        self.stats = ProducerStats()
        # A scenario's outcome is committed atomically (entries into the buffer, rewards into the EMA, counters, index
        # into ``done``) under this lock; a checkpoint holds it while it captures the buffer and the EMA (resume.py).
        self.commit_lock = asyncio.Lock()
        self.done: set[int] = set()  # global indices of the scenarios whose outcome is committed
        self.on_commit: Callable[[dict], None] | None = None  # called under the lock with each commit's record

    def state_dict(self) -> dict:
        """Counters and committed scenario indices (take it under :meth:`paused` for a consistent checkpoint)."""
        return {"stats": asdict(self.stats), "done": sorted(self.done)}

    def load_state_dict(self, state: dict) -> None:
        self.stats = ProducerStats(**state["stats"])
        self.done = {int(i) for i in state["done"]}

    async def paused(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``await fn()`` with commits paused (generation goes on); the checkpoint capture point."""
        async with self.commit_lock:
            return await fn()

    async def _generate_complete(self, session: str, prompt_ids: list, sampling: dict):
        """One complete generation: an aborted one (finish reason ``abort``: cut by a weight update) or a raised
        call is retried from the same prompt under the then-served policy; ``ScenarioDropped`` after the bound."""
        cause = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats.retries += 1
            try:
                out = await self.generate(session, prompt_ids, dict(sampling))
            except Exception as exc:  # noqa: BLE001 - a replica error: retried, then the scenario is dropped
                cause = f"generate raised {exc!r}"
                continue
            if str(getattr(out, "stop_reason", "") or "") in _ABORTED:
                self.stats.aborted += 1  # never recorded: its tokens are not one complete draw from one policy
                cause = "generation aborted by the server"
                continue
            return out
        raise ScenarioDropped(f"{cause} ({self.max_retries + 1} attempts)")

    async def _grade(self, scenario: Scenario, text: str, turn: int, think_open: bool) -> Grade:
        cause = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats.retries += 1
            try:
                return await asyncio.to_thread(scenario.grade, text, turn, think_open)
            except Exception as exc:  # noqa: BLE001 - the grading call itself failed (not a grader verdict)
                cause = f"grading raised {exc!r}"
        raise ScenarioDropped(f"{cause} ({self.max_retries + 1} attempts)")

    # ------------------------------------------------------------------ one scenario
    async def run_scenario(self, scenario: Scenario, scenario_index: int, sampling: dict,
                           learn_icl: bool) -> list[StepRecord]:
        """Play ``scenario`` turn by turn; the reply to turn t becomes part of the context of turn t+1."""
        replies: list[str] = []
        records: list[StepRecord] = []
        session = uuid.uuid4().hex  # sticky session: every turn of a scenario goes to the same server
        prev = None  # scenario mode: (prompt text, prompt ids, reply ids) of the previous turn
        for turn in range(scenario.num_turns):
            system = None
            if self.icl_memory is not None:
                system = self.icl_memory.system_prompt(scenario.system_prompt)
            messages = scenario.messages(turn, replies, system_prompt=system)
            if self.entry_unit == "scenario" and prev is not None:
                ext = self.renderer.extend(prev[0], prev[1], prev[2], messages)
                if ext is None:
                    self.stats.unconcatenable += 1  # the template rewrites earlier turns: no single sequence
                    raise ScenarioDropped("the chat template re-renders earlier turns; a per-scenario entry needs "
                                          "each prompt to extend the previous prompt + reply")
                prompt_ids, prompt_text, think_open = ext
            else:
                prompt_ids, think_open = self.renderer(messages)
                prompt_text = self.renderer.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False) if self.entry_unit == "scenario" else ""
            if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
                self.stats.prompt_too_long += 1
                break
            t0 = time.perf_counter()
            out = await self._generate_complete(session, prompt_ids, sampling)
            latency = time.perf_counter() - t0
            token_ids = [int(t) for t in out.token_ids]
            if not token_ids:
                self.stats.empty_replies += 1  # no token: no step to grade or train on; the scenario ends, counted
                break
            logps = out.log_probs
            if logps is None or len(logps) != len(token_ids):
                raise RuntimeError(
                    "the rollout server returned no per-token log-probs (or a wrong count); CLaaS needs the "
                    "behaviour log-prob of every sampled token (sampling_params['logprobs']=True)"
                )
            text = self.renderer.decode(token_ids)
            grade = await self._grade(scenario, text, turn, think_open)
            extra = getattr(out, "extra_fields", None) or {}
            version = extra.get("global_steps")
            records.append(StepRecord(
                scenario_index=scenario_index, step_idx=turn, prompt_ids=prompt_ids, response_ids=token_ids,
                behaviour_logprob=float(math.fsum(float(x) for x in logps)),
                version=int(version) if version is not None else None, grade=grade, latency_s=latency,
                teacher_prompt_ids=self._teacher_prompt(messages, grade),
            ))
            self.stats.generated_tokens += len(token_ids)
            self.stats.generate_s += latency
            if learn_icl and self.icl_memory is not None and grade.feedback is not None:
                self.icl_memory.add_feedback(grade.feedback, scenario_id=scenario.scenario_id,
                                             attack=scenario.user_turns[turn], response=text)
            replies.append(text)
            prev = (prompt_text, prompt_ids, token_ids)
        return records

    def _teacher_prompt(self, messages: list[dict], grade: Grade) -> list[int] | None:
        """SDPO teacher context x' as token ids (docs/math.md §A.3.3), or None (no feedback / passing step / not
        SDPO)."""
        if self.sdpo_reprompt is None or grade.reward is None:
            return None
        from claas_verl.losses.sdpo import teacher_messages

        teacher = teacher_messages(messages, grade.feedback, reward=grade.reward,
                                   reprompt_success=bool(self.sdpo_reprompt.get("reprompt_success", False)))
        return None if teacher is None else self.renderer(teacher)[0]

    # ------------------------------------------------------------------ training stream
    def _to_entry(self, rec: StepRecord, scenario: Scenario) -> ReplayEntry:
        return ReplayEntry(
            scenario_id=rec.scenario_index,
            step_idx=rec.step_idx,
            prompt_ids=rec.prompt_ids,
            response_ids=rec.response_ids,
            # A sum of log-probs is <= 0; float rounding of many ~0 terms can leave a tiny positive residue.
            behaviour_logprob=min(rec.behaviour_logprob, 0.0),
            reward=rec.grade.reward,
            feedback=rec.grade.feedback,
            P=rec.version,
            metadata={"scenario": scenario.scenario_id,
                      **({TEACHER_IDS_KEY: rec.teacher_prompt_ids} if rec.teacher_prompt_ids else {})},
        )

    async def _produce_one(self, scenario: Scenario, index: int, sem: asyncio.Semaphore) -> None:
        async with sem:
            sampling = {**TRAIN_SAMPLING, "logprobs": True, "max_tokens": self.max_new_tokens}
            try:
                records, dropped = await self.run_scenario(scenario, index, sampling, learn_icl=True), None
            except ScenarioDropped as exc:
                records, dropped = [], str(exc)
        async with self.commit_lock:
            accepted = await self._commit(scenario, index, records, dropped)
            self.done.add(index)
            if self.on_commit is not None:
                self.on_commit({"scenario": index, "accepted": accepted, "dropped": dropped is not None})

    async def _commit(self, scenario: Scenario, index: int, records: list[StepRecord], dropped: str | None) -> int:
        """One scenario's outcome into the buffer, the EMA and the counters (caller holds ``commit_lock``);
        returns the number of entries the buffer accepted."""
        if dropped is not None:
            self.stats.dropped_scenarios += 1
            self.stats.last_drop_cause = dropped
            return 0
        self.stats.scenarios += 1
        self.stats.steps += len(records)
        entries = []
        for rec in records:
            if rec.grade.reward is None:
                self.stats.none_rewards += 1  # docs/math.md §A.1.4: a grader error never reaches the buffer
                continue
            self.stats.reward_sum += rec.grade.reward
            self.stats.versions.append(rec.version)
            entries.append(self._to_entry(rec, scenario))
        if self.entry_unit == "scenario":
            if not records or len(entries) != len(records):
                return 0  # docs/math.md §A.1.5: a scenario with any None step is dropped (counted in none_rewards)
            entries = [ScenarioEntry(steps=entries, reward_agg="min", metadata={"scenario": scenario.scenario_id})]
        if not entries or self.replay is None:
            return 0
        self.stats.entries_sent += len(entries)
        accepted = int(await self.replay.add.remote(send_format(self.replay, entries)))
        self.stats.entries_accepted += accepted
        if self.ema_stats is not None and accepted:
            # docs/math.md §A.3.1: the EMA sees every inserted (non-None) reward, at insertion time. A batch is one
            # scenario's
            # steps; when the buffer refused some of them (stale on arrival, duplicate) the accepted ones cannot be
            # told apart from the count alone, so the EMA takes the batch only when all of it was accepted.
            if accepted == len(entries):
                with self.ema_lock:
                    self.ema_stats.update_many(e.reward for e in entries)
            else:
                self.stats.ema_skipped += accepted
        return accepted

    async def run_split(self, scenarios: Sequence[Scenario], index_offset: int = 0,
                        skip: Sequence[int] = ()) -> dict:
        """Produce every scenario of one split (``max_concurrent`` at a time), except the global indices in ``skip``
        (a resumed split's committed scenarios); return the cumulative stats."""
        sem = asyncio.Semaphore(self.max_concurrent)
        skip = set(skip)
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*[self._produce_one(s, index_offset + i, sem) for i, s in enumerate(scenarios)
                                   if index_offset + i not in skip])
        finally:
            self.stats.rollout_wall_s += time.perf_counter() - t0
        return self.stats.as_dict()

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, scenarios: Sequence[Scenario], n_samples: int = 1, temperature: float = 1.0,
                       max_new_tokens: int | None = None) -> dict:
        """Mean pass rate of the served policy over the graded steps of ``scenarios`` (no insertion, no ICL learning).

        Returns ``{"pass_rate", "graded", "errors"}``; ``pass_rate`` is NaN when no step could be graded.
        """
        sampling = {"temperature": float(temperature), "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                    "logprobs": True, "max_tokens": int(max_new_tokens or self.max_new_tokens)}
        sem = asyncio.Semaphore(self.max_concurrent)

        async def one(s: Scenario, i: int) -> list[StepRecord]:
            async with sem:
                try:
                    return await self.run_scenario(s, i, sampling, learn_icl=False)
                except ScenarioDropped:
                    return []  # no graded step: the cell averages the scenarios that could be played

        runs = await asyncio.gather(*[one(s, i) for i, s in enumerate(scenarios) for _ in range(n_samples)])
        rewards = [r.grade.reward for recs in runs for r in recs]
        graded = [r for r in rewards if r is not None]
        return {
            "pass_rate": float(sum(graded) / len(graded)) if graded else float("nan"),
            "graded": len(graded),
            "errors": len(rewards) - len(graded),
        }
