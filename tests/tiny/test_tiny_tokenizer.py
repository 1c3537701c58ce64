"""Tiny tokenizer: byte-level round trip, single-id added tokens, Qwen conventions, ChatML + thinking."""

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from claas_verl.tiny import ensure_tiny
from claas_verl.tiny.tokenizer import ADDED_TOKENS, CHAT_TEMPLATE, train_tokenizer

torch.set_num_threads(1)  # shared 2-core machine: avoid intra-op thread thrash during the bundle build


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny()


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny.student)


def test_vocab_is_1024_and_matches_model_config(tiny, tok):
    assert len(tok) == 1024
    assert json.loads((tiny.student / "config.json").read_text())["vocab_size"] == len(tok)


def test_added_tokens_are_single_ids_in_fixed_order(tok):
    # ids 0..4 in ADDED_TOKENS order: <|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>
    for expected_id, token in enumerate(ADDED_TOKENS):
        assert tok.encode(token, add_special_tokens=False) == [expected_id]
        # also inside running text, glued to other characters
        ids = tok.encode(f"ab{token}cd", add_special_tokens=False)
        assert ids.count(expected_id) == 1


def test_qwen_eos_pad_convention(tiny, tok):
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert tok.bos_token is None
    gen = json.loads((tiny.student / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0] and gen["pad_token_id"] == 0


def test_think_tokens_survive_skip_special_tokens(tok):
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|><|endoftext|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"
    assert tok.decode(ids) == "<think>\nhm\n</think>\n\nok<|im_end|><|endoftext|>"


@pytest.mark.parametrize("text", [
    "Hello  world\n\n  x",
    "x = 3\n    y\tz  \n",
    "Ünïcödé café naïve 😀 日本語",
    "Compute (12 + 7) * 3. Put the final answer in \\boxed{}.",
    "#### 1234567",
    "",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_loaded_tokenizer_encodes_like_the_trained_one(tiny, tok):
    # AutoTokenizer builds transformers' Qwen2Tokenizer, which rebuilds its normaliser and
    # pre-tokeniser in code; the merges were trained for exactly those, so both must agree.
    raw = Tokenizer.from_file(str(tiny.student / "tokenizer.json"))
    texts = ["Bob has 27 apples and gets 14 more.", "def f(x):\n    return x ** 2\n", "it's OK, they'll see"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    # Qwen splits numbers into single digits: "1234" is four tokens.
    assert len(tok.encode("1234", add_special_tokens=False)) == 4


def test_no_tokens_added_on_encode(tok):
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    {"role": "user", "content": "Thanks"},
]
RENDERED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
)


def test_chat_template_without_generation_prompt(tok):
    assert tok.apply_chat_template(CONVO, tokenize=False) == RENDERED


def test_chat_template_generation_prompt_thinking_on(tok):
    expected = RENDERED + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True) == expected
    assert tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True, enable_thinking=True) == expected


def test_chat_template_generation_prompt_thinking_off(tok):
    out = tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert out == RENDERED + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # without a generation prompt, enable_thinking changes nothing
    assert tok.apply_chat_template(CONVO, tokenize=False, enable_thinking=False) == RENDERED


def test_chat_template_tokenized_equals_encoded_text(tok):
    text = tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    out = tok.apply_chat_template(CONVO, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|>
    assert 3 in ids and 4 in ids  # <think>, </think> as single ids


def test_multi_turn_rendering_is_prefix_consistent(tok):
    # Rendering a conversation and then appending a turn must extend, not rewrite, the text
    # (verl's multi-turn loop concatenates token ids turn by turn).
    short = tok.apply_chat_template(CONVO[:3], tokenize=False)
    assert tok.apply_chat_template(CONVO, tokenize=False).startswith(short)


def test_saved_template_is_ours(tok):
    assert tok.chat_template == CHAT_TEMPLATE


def test_vocab_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(["hello"], vocab_size=100)
