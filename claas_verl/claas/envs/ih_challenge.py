"""Loader for IH-Challenge-style JSONL scenarios (CLaaS paper App. "IH-Challenge", CLaaS paper (zh) App.
A.1/A.3).

One JSON object per line. Canonical field names, with the aliases also accepted:

================  ==========================================================  ========================================
field             meaning                                                     aliases
================  ==========================================================  ========================================
``id``            unique scenario id (str or int)                             ``scenario_id``, ``uid``, ``name``
``system_prompt`` defender rules, given as the system message (CLaaS paper)           ``system``,
``defender_system_prompt``,
                                                                              ``system_message``, ``instructions``
``user_turns``    attacker user messages, in order (a str is one turn)        ``attacker_messages``, ``attacks``,
                                                                              ``user_messages``, ``turns``,
                                                                              ``attacker_message``, ``user_message``
``grader``        Python source defining ``grade_output_correct(output)``     ``grader_code``, ``grader_source``,
                  (or ``(output, user_context)``) returning bool              ``grade_output_correct``, ``verifier``
``fail_feedback`` optional feedback text for a failed step                    ``feedback``
``metadata``      optional free-form dict kept in ``Scenario.meta``           ``meta``
================  ==========================================================  ========================================

Instead of ``system_prompt``/``user_turns`` a line may carry OpenAI-style
``messages`` (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``):
the system messages are joined into the system prompt, user messages become
the turns, assistant messages are ignored (the defender's replies are generated).

Graders run in the OS sandbox of :mod:`claas_verl.sandbox` (per call: own network and PID
namespaces, empty chroot, uid nobody, seccomp, time/memory/output limits; stdlib only), in a process-wide
pool of ``n_workers`` sandboxes so concurrent rollouts grade in parallel. :class:`IHChallengeEnv` refuses
to load (``SandboxUnavailable``) on a machine that cannot isolate them, unless the ``sandbox`` config sets
``allow_weak_isolation: true``. A grader failure of any kind, sandbox failures included, is reward None
(docs/math.md §A.1.4). They receive the *visible* reply
(thinking stripped) and, if they take two positional parameters, the
concatenated user messages up to the graded turn (CLaaS paper App.). Grader source is
compiled (not run) at load time so a syntax error is reported with its line.
Scenarios with more than ``max_turns`` user turns keep the first ``max_turns``
(docs/math.md §A.1.5, T = 4) and record the original count in ``meta["num_user_turns_in_file"]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from claas_verl.claas.envs.base import DEFAULT_MAX_TURNS, GENERIC_FAIL_FEEDBACK, Scenario
from claas_verl.claas.envs.environment import Environment
from claas_verl.claas.envs.sandboxed import SandboxedVerifier
from claas_verl.sandbox import DEFAULT_LIMITS, SandboxLimits, require_isolation, shared_pool

FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "id": ("id", "scenario_id", "uid", "name"),
    "system_prompt": ("system_prompt", "system", "defender_system_prompt", "system_message", "instructions"),
    "user_turns": ("user_turns", "attacker_messages", "attacks", "user_messages", "turns", "attacker_message",
                   "user_message"),
    "grader": ("grader", "grader_code", "grader_source", "grade_output_correct", "verifier"),
    "fail_feedback": ("fail_feedback", "feedback"),
    "metadata": ("metadata", "meta"),
}


def _pick(row: dict, field: str, where: str) -> Any:
    present = [a for a in FIELD_ALIASES[field] if a in row]
    if len(present) > 1:
        raise ValueError(f"{where}: fields {present} are aliases of '{field}'; keep only one")
    return row[present[0]] if present else None


def _content(msg: Any, where: str) -> str:
    content = msg.get("content") if isinstance(msg, dict) else None
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError(f"{where}: every message needs a string 'content'")
    return content


def parse_scenario(row: dict, where: str = "<row>", max_turns: int = DEFAULT_MAX_TURNS,
                   limits: SandboxLimits = DEFAULT_LIMITS, n_workers: int = 1) -> Scenario:
    """Build one :class:`Scenario` from a decoded JSONL object (see the module docstring for fields)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    sid = _pick(row, "id", where)
    if sid is None or isinstance(sid, bool) or not isinstance(sid, (str, int)) or str(sid) == "":
        raise ValueError(f"{where}: missing scenario id; add an 'id' field (aliases {FIELD_ALIASES['id'][1:]})")
    where = f"{where} (id={sid})"
    system, turns = _pick(row, "system_prompt", where), _pick(row, "user_turns", where)
    if "messages" in row:
        if system is not None or turns is not None:
            raise ValueError(f"{where}: give either 'messages' or 'system_prompt'/'user_turns', not both")
        msgs = row["messages"]
        if not isinstance(msgs, list):
            raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        system = "\n\n".join(_content(m, where) for m in msgs if m.get("role") in ("system", "developer"))
        turns = [_content(m, where) for m in msgs if m.get("role") == "user"]
    if not isinstance(system, str) or not system.strip():
        raise ValueError(f"{where}: missing or empty 'system_prompt' (aliases {FIELD_ALIASES['system_prompt'][1:]})")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: 'user_turns' must be a non-empty list of strings "
                         f"(aliases {FIELD_ALIASES['user_turns'][1:]})")
    source = _pick(row, "grader", where)
    if not isinstance(source, str) or "grade_output_correct" not in source:
        raise ValueError(f"{where}: 'grader' must be Python source defining grade_output_correct(output) -> bool "
                         f"(aliases {FIELD_ALIASES['grader'][1:]})")
    try:
        compile(source, f"<grader {sid}>", "exec")  # compile only: nothing of the grader runs in this process
    except SyntaxError as e:
        raise ValueError(f"{where}: grader source does not compile: {e}") from e
    feedback = _pick(row, "fail_feedback", where)
    if feedback is not None and not isinstance(feedback, str):
        raise ValueError(f"{where}: 'fail_feedback' must be a string")
    meta = _pick(row, "metadata", where) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: 'metadata' must be an object")
    meta = {**meta, "source": "ih_challenge_jsonl", "num_user_turns_in_file": len(turns)}
    return Scenario(
        scenario_id=str(sid),
        system_prompt=system,
        user_turns=tuple(turns[:max_turns]),
        verifier=SandboxedVerifier(source=source, fail_feedback=feedback or GENERIC_FAIL_FEEDBACK,
                                   limits=limits, n_workers=n_workers),
        meta=meta,
    )


def load_ih_challenge_jsonl(path: str | Path, max_turns: int = DEFAULT_MAX_TURNS,
                            limits: SandboxLimits = DEFAULT_LIMITS, n_workers: int = 1) -> list[Scenario]:
    """All scenarios of a JSONL file, in file order; blank lines are skipped, errors name the line."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: invalid JSON: {e}") from e
            out.append(parse_scenario(row, where, max_turns, limits, n_workers))
    if not out:
        raise ValueError(f"{path}: no scenarios found")
    return out


class IHChallengeEnv(Environment):
    """Scenarios from an IH-Challenge-style JSONL file; ``close()`` stops this process's grader sandboxes.

    ``n_workers``: sandboxes in the process-wide grading pool (parallel grading); ``limits``: per-call limits
    and the weak-isolation opt-in. Fails fast with ``SandboxUnavailable`` on a machine that cannot isolate.
    """

    name = "ih_challenge"

    def __init__(self, path: str | Path, max_turns: int = DEFAULT_MAX_TURNS,
                 limits: SandboxLimits = DEFAULT_LIMITS, n_workers: int = 1):
        if not (isinstance(n_workers, int) and n_workers >= 1):
            raise ValueError(f"ih_challenge: n_workers must be an int >= 1 (grader sandboxes), got {n_workers!r}")
        require_isolation(limits)
        self.limits, self.n_workers = limits, n_workers
        super().__init__(load_ih_challenge_jsonl(path, max_turns, limits, n_workers))

    def close(self) -> None:
        shared_pool(self.limits, self.n_workers).close()
