"""Sampling parameters of one chat request and the docs/math.md §0 rule for requests that feed training.

docs/math.md §0 [CHOICE]: an entry's behaviour log-prob must be the log-prob of the distribution that was actually
sampled, and the trainer recomputes log-probs as ``log_softmax(logits / 1)`` over the full vocabulary. So a request
whose response becomes a replay entry must sample with temperature 1, top-p 1, top-k off and no other logit processing
(penalties, min-p, logit bias, forced minimum length). Requests with other settings are served normally, but their entry
is rejected with the reasons from :func:`training_violations`.

The defaults here ARE the training settings, and backends always send every value explicitly: vLLM otherwise fills
omitted fields from the model's ``generation_config`` (Qwen3 ships top_k=20, top_p=0.95), which would silently make
the served distribution differ from the one the trainer assumes.

No torch, no HTTP imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The sampling settings of every request that produces a replay entry (docs/math.md §0).
TRAINING_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}

# Request fields this service understands; anything else in the body is ignored by the parser (OpenAI clients send
# e.g. "user", "stream_options") except the fields in _UNSUPPORTED, which change the response and are refused.
_UNSUPPORTED = {
    "tools": "tool calling is not supported by the CLaaS chat service",
    "tool_choice": "tool calling is not supported by the CLaaS chat service",
    "functions": "function calling is not supported by the CLaaS chat service",
    "response_format": "structured output constrains sampling and is not supported",
    "guided_json": "guided decoding constrains sampling and is not supported",
    "guided_regex": "guided decoding constrains sampling and is not supported",
}


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'{name}' must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"'{name}' must be in [{lo}, {hi}], got {value!r}")
    return float(value)


def _int(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{name}' must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"'{name}' must be >= {lo}, got {value}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (OpenAI chat-completions names plus vLLM's extensions).

    ``top_k`` of ``-1`` or ``0`` means off (vLLM accepts both). ``max_tokens`` None means the backend's default.
    ``stop`` holds stop strings (stop strings cut the text after sampling, so their entries are not recorded).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict = field(default_factory=dict)
    logprobs: bool = False  # whether the CLIENT asked for log-probs in its response (backends always request them)

    @classmethod
    def from_request(cls, body: dict[str, Any]) -> SamplingParams:
        """Parse and validate the sampling fields of a chat-completions body; ``ValueError`` names the field."""
        for name, why in _UNSUPPORTED.items():
            if body.get(name):
                raise ValueError(f"'{name}': {why}")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise ValueError(f"'stream' must be true or false, got {stream!r}")
        n = _int(body, "n", 1, lo=1)
        if n != 1:
            raise ValueError(f"'n' must be 1 (one response per request, one replay entry each), got {n}")
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
        max_tokens = _int(body, "max_tokens", max_tokens, lo=1)
        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"'stop' must be a string or a list of strings, got {stop!r}")
        logit_bias = body.get("logit_bias") or {}
        if not isinstance(logit_bias, dict):
            raise ValueError(f"'logit_bias' must be an object mapping token ids to biases, got {logit_bias!r}")
        top_k = _int(body, "top_k", -1, lo=-1)
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise ValueError(f"'logprobs' must be true or false, got {logprobs!r}")
        return cls(
            temperature=_number(body, "temperature", 1.0, lo=0.0),
            top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0),
            top_k=-1 if top_k == 0 else top_k,
            max_tokens=max_tokens,
            seed=_int(body, "seed", None),
            stop=tuple(stop),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0.0),
            min_p=_number(body, "min_p", 0.0, lo=0.0, hi=1.0),
            min_tokens=_int(body, "min_tokens", 0, lo=0),
            logit_bias=dict(logit_bias),
            logprobs=logprobs,
        )

    def non_default_processing(self) -> dict[str, Any]:
        """Logit-processing fields set away from their neutral values (backends without them must refuse)."""
        out = {}
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_p", 0.0), ("min_tokens", 0)):
            if getattr(self, name) != neutral:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        if self.stop:
            out["stop"] = list(self.stop)
        return out


def training_violations(params: SamplingParams) -> list[str]:
    """Why a response sampled with ``params`` may NOT become a replay entry (docs/math.md §0); empty when it may.

    Each reason names the field, its value and the required value.
    """
    reasons = []
    if params.temperature != 1.0:
        reasons.append(f"temperature={params.temperature:g} (recorded requests must sample at temperature 1)")
    if params.top_p != 1.0:
        reasons.append(f"top_p={params.top_p:g} (recorded requests must use top_p=1)")
    if params.top_k not in (-1, 0):
        reasons.append(f"top_k={params.top_k} (recorded requests must have top_k off: -1 or 0)")
    for name, value in params.non_default_processing().items():
        if name == "stop":
            reasons.append("stop strings cut the sampled text, so the masked tokens would not match the sample")
        else:
            reasons.append(f"{name}={value!r} alters the sampled distribution (recorded requests leave it unset)")
    return reasons


def violation_message(reasons: list[str]) -> str:
    """One line for the response's ``claas.reason`` field."""
    return "not recorded (docs/math.md §0: behaviour log-probs must be those of τ=1, top_p=1, top_k off): " + "; ".join(
        reasons
    )
