"""Token streaming: the events a backend yields while it generates, and incremental detokenization.

A backend's :meth:`~claas_verl.claas.service.backend.ChatBackend.stream` yields, in order:

1. one :class:`StreamStart` once the request runs (the policy version and model that serve it, fixed from here on);
2. any number of :class:`TokenDelta` (new visible text and the token ids / log-probs it came from) as tokens are
sampled; 3. one :class:`~claas_verl.claas.service.backend.Generation`: the complete response, exactly what a
non-streamed request
   returns; it (never the deltas) is what the service records.

The concatenation of the deltas' ``text`` equals the final ``Generation.text``.
"""

from __future__ import annotations

from dataclasses import dataclass

_INCOMPLETE = "\ufffd"  # what decode() shows for a UTF-8 sequence cut in the middle of a character


@dataclass(frozen=True)
class StreamStart:
    """The request runs: ``policy_version`` / ``model`` serve it from its first to its last token (docs/math.md
    §A.1.1)."""

    policy_version: int
    model: str


@dataclass(frozen=True)
class TokenDelta:
    """Newly sampled tokens: their visible ``text`` (may be empty, e.g. for EOS) and ``logprobs`` (or None)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None


class IncrementalDetokenizer:
    """Text deltas of a growing list of token ids whose concatenation is ``decode(all ids)``.

    Each :meth:`push` decodes the whole list again (a tokenizer's decode is not additive over token boundaries:
    a multi-byte character can span tokens, and byte-level BPE only yields text for whole characters) and returns
    what was appended since the last delta. Text that ends in a cut character is held back until the next token
    completes it; :meth:`finish` returns whatever is still held. Decoding is O(n) per token, which is small next to a
    forward pass for the response lengths a chat turn has.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids) -> str:
        """Add ``token_ids``; the newly visible text ('' while a character is incomplete)."""
        self.ids.extend(int(t) for t in token_ids)
        text = self._decode()
        if text.endswith(_INCOMPLETE) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self) -> tuple[str, str]:
        """``(last delta, full text)``: the held-back remainder and ``decode(all ids)``.

        With a tokenizer whose decode is not prefix-stable (a later token rewrites text already sent; byte-level BPE
        never does) the remainder is empty and the client's text may differ from the full text, which is what the
        grader sees. The recorded entry holds token ids, so training is not affected either way.
        """
        text = self._decode()
        return (text[len(self.sent):] if text.startswith(self.sent) else ""), text
