"""A byte-level BPE tokenizer trained locally, with Qwen-style ChatML and thinking tokens.

Conventions follow Qwen2/Qwen3 so recipes written for the real models work unchanged:

* ``<|im_end|>`` is the EOS token (it ends every chat turn, so generation stops there);
  ``<|endoftext|>`` is the pad token; there is no BOS token.
* ``<think>`` and ``</think>`` are single ids but *not* special: ``decode(...,
  skip_special_tokens=True)`` keeps them, as Qwen3 does, so reward functions see them.
* The chat template is ChatML. ``add_generation_prompt`` opens an assistant turn; with
  ``enable_thinking=False`` it also appends an empty thinking block
  ``<think>\\n\\n</think>\\n\\n`` (Qwen3's way of switching thinking off). Assistant
  content is rendered verbatim, including any ``<think>…</think>`` it holds (Qwen3 strips
  the thinking of earlier turns; we keep it so that multi-turn token sequences are
  prefix-consistent, which verl's multi-turn agent loop relies on).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

EOT_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS: tuple[str, ...] = (EOT_TOKEN, IM_START, IM_END)
THINK_TOKENS: tuple[str, ...] = (THINK_START, THINK_END)
ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + THINK_TOKENS  # ids 0..4, in this order

# Qwen2's pre-tokenisation pattern: contractions, letter runs (with one leading non-letter),
# single digits, punctuation runs, newline runs, other whitespace.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Jinja (rendered by transformers' sandboxed environment). Whitespace control ("{%-", "{{-")
# keeps the rendered text exactly ChatML with no stray newlines.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Every byte is in the initial alphabet, so any NFC-normalised string round-trips exactly. The five added
    tokens take ids 0..4 (:data:`ADDED_TOKENS` order). ``vocab_size`` is an upper bound: a
    small corpus may yield fewer merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(ADDED_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs > {256 + len(ADDED_TOKENS)}")
    tok = Tokenizer(models.BPE())
    # The same normaliser and pre-tokeniser as transformers' Qwen2Tokenizer, which is what
    # AutoTokenizer instantiates for a qwen2 checkpoint and which rebuilds these from its
    # own code: training with anything else would make the saved merges disagree with the
    # loaded tokenizer (e.g. Qwen splits numbers into single digits).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    # The trainer registers every listed token as special; Qwen3 keeps <think>/</think>
    # non-special so they survive skip_special_tokens. Flip the flag in the serialized form.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in THINK_TOKENS:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        padding_side="left",  # decoder-only generation pads on the left, as Qwen's tokenizer does
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_token_ids(tokenizer) -> dict[str, int]:
    """Map each added token to its single id; raises if one got split (a broken tokenizer)."""
    ids = {}
    for token in ADDED_TOKENS:
        enc = tokenizer.encode(token, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"token {token!r} encodes to {enc}, not one id; rebuild the tiny tokenizer")
        ids[token] = enc[0]
    return ids
