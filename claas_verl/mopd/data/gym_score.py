"""Reasoning-gym scoring of one reply, offline: the entry is rebuilt from the row's ``extra_info.meta``.

The reward of the MOPD prompt files (:mod:`claas_verl.mopd.data.rewards`, which dispatches ``reasoning_gym/<task>``
rows here); the tiny gym bundle (:mod:`claas_verl.tiny.gym`) scores its accuracy during the build with it too.
"""

from __future__ import annotations

import json
from functools import cache


@cache
def _dataset(task: str, size: int, seed: int, config: str = "{}"):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config))


def _meta(extra_info) -> dict:
    meta = (extra_info or {}).get("meta")
    if not meta:
        raise ValueError("reasoning_gym rows need extra_info.meta (written by python -m claas_verl.mopd.data mopd)")
    return json.loads(meta) if isinstance(meta, str) else dict(meta)


def score_reasoning_gym(reply: str, extra_info: dict | None) -> float:
    """The task's own reasoning-gym score of ``reply`` (thinking already removed): the last ``<answer>`` tag, or the
    whole reply when ``meta.answer_format`` is ``plain`` (the tiny models); 0.0 when there is no answer."""
    from reasoning_gym.utils import extract_answer

    m = _meta(extra_info)
    gym = _dataset(m["task"], int(m["size"]), int(m["seed"]), json.dumps(m.get("config") or {}, sort_keys=True))
    fmt = m.get("answer_format", "tag")
    if fmt not in ("tag", "plain"):
        raise ValueError(f"extra_info.meta.answer_format={fmt!r}: expected 'tag' (<answer>...</answer>) or 'plain'")
    answer = reply.strip() if fmt == "plain" else extract_answer(reply)
    return float(gym.score_answer(answer=answer, entry=gym[int(m["index"])])) if answer is not None else 0.0
