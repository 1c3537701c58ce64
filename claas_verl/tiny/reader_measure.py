"""Does a tiny student read instructions in context? Pass rates of its replies per rule family, by context.

The reader bundle (:mod:`claas_verl.tiny.reader`) is built to follow a rule when its system prompt states it and to
keep its base rate when it does not; this module measures both, and the contexts SDPO's teacher and the ICL baseline
add, on held-out scenarios (``benchmarks/plans/claas_feedback.md``, step 1):

=========  ==========================================================================================
condition  context of the graded reply (turn t of a conversation of :data:`TURNS` turns)
=========  ==========================================================================================
base       the system prompt without its rule line (only "You are ... Follow these rules ...:"),
           the conversation's own earlier replies
student    the scenario's system prompt with the rule (what the stream's policy sees)
teacher    the student's context, the last user turn re-prompted with the verifier's feedback on a failed
           student reply at that step (SDPO's teacher context, :func:`claas_verl.losses.sdpo.teacher_messages`)
icl        the student's context with ICL's feedback block of that one failed reply in the system prompt
           (:class:`claas_verl.claas.envs.icl.ICLFeedbackMemory`, the tiny ICL recipe's 1,024-token budget)
=========  ==========================================================================================

Held out: per family, :data:`HELD_OUT_SCENARIOS` one-rule scenarios of the generator at the stream's seed 0 (the
build uses seeds ≥ 1000); for the stream's two families the first ones of that family in the stream's own generator
(``families=STREAM_FAMILIES``, so mostly the stream's pool), for the others ``families=(family,)``. Each scenario
is rolled out :data:`ROLLOUTS` times for :data:`TURNS` turns, replies of :data:`MAX_NEW_TOKENS` tokens at τ = 1
(512 graded replies per family for base and student). The teacher and ICL contexts are those of the student's
steps: the feedback is the student's reply's when it failed, else that of the first failing one of
:data:`EXTRA_DRAWS` more student replies at that step; a step with no failing reply has no teacher (as in SDPO) and
is left out of both, so their ``n`` can be smaller.

Intervals: :func:`diff_interval`, the two-proportion (Wald) 95% interval of a difference of pass rates. It treats
replies as independent; replies of one scenario are correlated, so it is narrower than a scenario-level interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from claas_verl.claas.envs.base import Scenario
from claas_verl.claas.envs.rule_following import ALL_FAMILIES, make_rule_scenario
from claas_verl.utils.prompt_rows import stable_seed

STREAM_FAMILIES = ("capital_start", "end_punctuation")  # the compatible stream's rules: the gated families
HELD_OUT_SEED = 0  # the stream's generator seed (claas.env.kwargs.seed)
HELD_OUT_SCENARIOS = 32
TURNS = 4  # the stream's T in the plan
ROLLOUTS = 4
MAX_NEW_TOKENS = 12
EXTRA_DRAWS = 8
DRAWS_PER_ROUND = 2
ICL_TOKEN_BUDGET = 1024  # recipes/claas/at_scale/icl_tiny.yaml
CONDITIONS = ("base", "student", "teacher", "icl")
GEN_BATCH = 128
Z95 = 1.959963984540054

# The plan's gates (pre-declared): (name, statistic, threshold, kind). "min": the statistic ≥ threshold and its 95%
# interval above 0; "max": the statistic ≤ threshold; "abs_max": |statistic| ≤ threshold.
GATES = (
    ("base rate kept", ("base", "pre_sft_base"), 0.05, "abs_max"),
    ("reads the system prompt", ("student", "base"), 0.15, "min"),
    ("room to learn", ("student", None), 0.70, "max"),
    ("teacher knows more", ("teacher", "student"), 0.15, "min"),
)


def held_out_scenarios(family: str, n: int | None = None, seed: int = HELD_OUT_SEED,
                       turns: int = TURNS) -> list[Scenario]:
    """The first ``n`` (default :data:`HELD_OUT_SCENARIOS`) one-rule scenarios of ``family`` from the generator at
    ``seed`` (module docstring)."""
    n = HELD_OUT_SCENARIOS if n is None else n
    if family not in ALL_FAMILIES:
        raise ValueError(f"family {family!r} is not a rule family; choose from {ALL_FAMILIES}")
    pool = STREAM_FAMILIES if family in STREAM_FAMILIES else (family,)
    out, index = [], 0
    while len(out) < n:
        sc = make_rule_scenario(seed, index, turns, 1, 1, pool)
        if sc.meta["families"] == [family]:
            out.append(sc)
        index += 1
    return out


def without_rule(scenario: Scenario) -> str:
    """The scenario's system prompt without its rule lines (its first line: persona and the lead-in)."""
    return scenario.system_prompt.split("\n", 1)[0]


@dataclass
class Step:
    """One graded reply of a conversation: the messages that prompted it, the reply and its grade."""

    scenario: Scenario
    turn: int
    messages: list[dict]
    text: str
    ids: list[int]
    passed: bool
    feedback: str | None


class Sampler:
    """Batched τ = 1 sampling of ``max_new_tokens``-token replies from a causal LM with a chat template."""

    def __init__(self, model, tok, max_new_tokens: int = MAX_NEW_TOKENS):
        from claas_verl.tiny.gym import stop_and_pad_ids

        self.model, self.tok, self.max_new_tokens = model, tok, max_new_tokens
        self.eos, self.pad = stop_and_pad_ids(tok)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def sample(self, prompts: Sequence[list[dict]], key: tuple, k: int = 1) -> list[list[tuple[str, list[int]]]]:
        """``k`` replies ``(visible text, token ids up to and including the stop token)`` per prompt; the sampling
        RNG is seeded from ``key`` and the batch index, so the same call gives the same replies."""
        import torch

        ids = [self.prompt_ids(m) for m in prompts for _ in range(k)]
        order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))  # batches of like lengths: less padding
        flat: list[tuple[str, list[int]]] = [("", [])] * len(ids)
        for b in range(0, len(order), GEN_BATCH):
            rows = order[b: b + GEN_BATCH]
            chunk = [ids[i] for i in rows]
            width = max(len(x) for x in chunk)
            x = torch.full((len(chunk), width), self.pad)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, seq in enumerate(chunk):  # left padding: every reply starts at column ``width``
                x[row, width - len(seq):] = torch.tensor(seq)
                att[row, width - len(seq):] = 1
            torch.manual_seed(stable_seed("claas_reader.sample", *key, b) % (2**31))
            with torch.no_grad():
                y = self.model.generate(input_ids=x, attention_mask=att, max_new_tokens=self.max_new_tokens,
                                        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=self.eos,
                                        pad_token_id=self.pad)
            for i, row in zip(rows, y[:, width:].tolist()):
                cut = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
                flat[i] = (self.tok.decode(row[:cut], skip_special_tokens=True), row[:cut])
        return [flat[i * k:(i + 1) * k] for i in range(len(prompts))]


def grade(scenario: Scenario, turn: int, messages: list[dict], reply: tuple[str, list[int]]) -> Step:
    g = scenario.grade(reply[0], turn)
    return Step(scenario, turn, messages, reply[0], reply[1], g.reward == 1.0, g.feedback)


def rollouts(sampler: Sampler, scenarios: Sequence[Scenario], systems: Sequence[str], n: int, key: tuple,
             turns: int = TURNS) -> list[list[Step]]:
    """``n`` conversations per scenario with system prompt ``systems[i]``, each reply sampled and graded; a
    conversation's later turns see its own earlier replies."""
    convs = [(sc, system) for sc, system in zip(scenarios, systems) for _ in range(n)]
    steps: list[list[Step]] = [[] for _ in convs]
    for t in range(turns):
        msgs = [sc.messages(t, [s.text for s in steps[i]], system_prompt=system) for i, (sc, system) in
                enumerate(convs)]
        for i, (reply,) in enumerate(sampler.sample(msgs, (*key, t))):
            steps[i].append(grade(convs[i][0], t, msgs[i], reply))
    return steps


def feedback_contexts(step: Step, failed: tuple[str, str], count_tokens) -> tuple[list[dict], list[dict]]:
    """(teacher messages, ICL messages) of ``step`` given a failed reply ``(text, feedback)`` at its context."""
    from claas_verl.claas.envs.icl import ICLFeedbackMemory
    from claas_verl.losses.sdpo import teacher_messages

    text, feedback = failed
    teacher = teacher_messages(step.messages, feedback, reward=0.0)
    memory = ICLFeedbackMemory(count_tokens, token_budget=ICL_TOKEN_BUDGET)
    memory.add_feedback(feedback, scenario_id=step.scenario.scenario_id, attack=step.scenario.user_turns[step.turn],
                        response=text)
    icl = [dict(m) for m in step.messages]
    icl[0]["content"] = memory.system_prompt(icl[0]["content"])
    return teacher, icl


def failed_replies(sampler: Sampler, steps: Sequence[Step], key: tuple) -> list[tuple[str, str] | None]:
    """Per step: ``(text, feedback)`` of its reply if it failed, else of the first failing one of
    :data:`EXTRA_DRAWS` more replies at its context (drawn :data:`DRAWS_PER_ROUND` at a time); None when none fails."""
    out: list[tuple[str, str] | None] = [(s.text, s.feedback) if not s.passed else None for s in steps]
    for r in range(EXTRA_DRAWS // DRAWS_PER_ROUND):  # in rounds, so a step stops drawing once one reply failed
        again = [i for i, f in enumerate(out) if f is None]
        if not again:
            break
        extra = sampler.sample([steps[i].messages for i in again], (*key, "extra", r), k=DRAWS_PER_ROUND)
        for i, replies in zip(again, extra):
            for reply in replies:
                g = grade(steps[i].scenario, steps[i].turn, steps[i].messages, reply)
                if not g.passed:
                    out[i] = (g.text, g.feedback)
                    break
    return out


def measure_family(sampler: Sampler, family: str, key: tuple) -> dict[str, list]:
    """``{condition: [pass rate, n]}`` of one family (module docstring)."""
    scenarios = held_out_scenarios(family)
    count = lambda s: len(sampler.tok.encode(s, add_special_tokens=False))  # noqa: E731
    out: dict[str, list] = {}
    base = rollouts(sampler, scenarios, [without_rule(sc) for sc in scenarios], ROLLOUTS, (*key, family, "base"))
    student = rollouts(sampler, scenarios, [sc.system_prompt for sc in scenarios], ROLLOUTS,
                       (*key, family, "student"))
    for name, convs in (("base", base), ("student", student)):
        flat = [s for conv in convs for s in conv]
        out[name] = [round(sum(s.passed for s in flat) / len(flat), 4), len(flat)]
    steps = [s for conv in student for s in conv]
    failed = failed_replies(sampler, steps, (*key, family))
    kept = [(s, f) for s, f in zip(steps, failed) if f is not None]
    contexts = [feedback_contexts(s, f, count) for s, f in kept]
    for j, name in ((0, "teacher"), (1, "icl")):
        if not kept:
            out[name] = [None, 0]
            continue
        replies = sampler.sample([c[j] for c in contexts], (*key, family, name))
        passed = [grade(s.scenario, s.turn, c[j], r).passed for (s, _), c, (r,) in zip(kept, contexts, replies)]
        out[name] = [round(sum(passed) / len(passed), 4), len(passed)]
    out["max_prompt_tokens"] = max(len(sampler.prompt_ids(s.messages)) for s in steps)
    return out


def measure(model, tok, key: tuple, families: Sequence[str] = ALL_FAMILIES, label: str = "[tiny reader]"
            ) -> dict[str, dict[str, list]]:
    """``{family: {condition: [pass rate, n]}, ...}`` of ``model`` (module docstring); deterministic in ``key``."""
    from claas_verl.utils.progress import track

    sampler = Sampler(model, tok)
    return {f: measure_family(sampler, f, key) for f in track(families, f"{label} measuring", unit="families")}


def diff_interval(p1: float, n1: int, p2: float, n2: int) -> tuple[float, float, float]:
    """``(p1 − p2, low, high)``: the two-proportion (Wald) 95% interval of a difference of two pass rates."""
    if n1 < 1 or n2 < 1:
        raise ValueError(f"diff_interval needs n1, n2 >= 1, got {n1}, {n2}")
    d = p1 - p2
    half = Z95 * math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    return d, d - half, d + half


def reading_gates(table: Mapping[str, Mapping[str, Sequence]], families: Sequence[str] = STREAM_FAMILIES
                  ) -> dict[str, dict[str, dict]]:
    """Each of :data:`GATES` for each family of ``families``, from ``table`` (``{family: {condition: [rate, n]}}``
    with the conditions and their ``pre_sft_`` twins): ``{family: {gate: {value, low, high, threshold, passed}}}``.
    A gate whose statistic cannot be computed (a condition with n = 0) fails."""
    out: dict[str, dict[str, dict]] = {}
    for family in families:
        row = table[family]
        out[family] = {}
        for name, (a, b), threshold, kind in GATES:
            if row[a][1] == 0 or (b is not None and row[b][1] == 0):
                out[family][name] = {"value": None, "low": None, "high": None, "threshold": threshold,
                                     "passed": False}
                continue
            if b is None:
                value, low, high = row[a][0], None, None
            else:
                value, low, high = diff_interval(row[a][0], row[a][1], row[b][0], row[b][1])
            passed = {"min": value >= threshold and low is not None and low > 0,
                      "max": value <= threshold,
                      "abs_max": abs(value) <= threshold}[kind]
            out[family][name] = {"value": round(value, 4), "low": None if low is None else round(low, 4),
                                 "high": None if high is None else round(high, 4), "threshold": threshold,
                                 "passed": bool(passed)}
        i = diff_interval(row["icl"][0], row["icl"][1], row["student"][0], row["student"][1]) \
            if row["icl"][1] and row["student"][1] else (None, None, None)
        out[family]["icl uses its context (reported, not a gate)"] = {
            "value": None if i[0] is None else round(i[0], 4), "low": None if i[1] is None else round(i[1], 4),
            "high": None if i[2] is None else round(i[2], 4), "threshold": None, "passed": None}
    return out


def gates_pass(gates: Mapping[str, Mapping[str, Mapping]]) -> bool:
    """Whether every gate (those with a threshold) of every family passed."""
    return all(g["passed"] for fam in gates.values() for g in fam.values() if g["threshold"] is not None)


def merged_table(after: Mapping[str, Mapping[str, Sequence]], before: Mapping[str, Mapping[str, Sequence]]
                 ) -> dict[str, dict[str, list]]:
    """The manifest's ``instruction_reading``: per family the conditions of ``after`` and, as ``pre_sft_<c>``,
    of ``before`` (the student before the build's fine-tune)."""
    return {f: {**{c: list(after[f][c]) for c in CONDITIONS},
                **{f"pre_sft_{c}": list(before[f][c]) for c in CONDITIONS}} for f in after}
