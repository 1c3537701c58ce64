"""Chat messages: validation and rendering to prompt token ids with the policy's chat template."""

from __future__ import annotations

from typing import Any

_ROLES = ("system", "developer", "user", "assistant")


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages and flatten text parts; ``ValueError`` names the offending message.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined with no separator, as
    OpenAI does). Images, audio and tool messages are refused: the service records text-only trajectories.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_ROLES}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text part {{type: 'text', text: str}}")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


#: How much longer than its messages a rendered chat may be: role markers and a template's own system text. A template
#: argument that makes the template expand beyond this is refused (the prompt would not be what the client sent).
TEMPLATE_OVERHEAD_CHARS = 16_384
TEMPLATE_OVERHEAD_PER_MESSAGE = 256


def render_prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the chat context with the generation prompt appended (what the policy is conditioned on).

    Rendered to text first and then encoded without extra special tokens, the same path vLLM's chat endpoint takes,
    so the ids match what a vLLM server sees for the same template. Blocking (Jinja, the tokenizer): the service
    calls it in a worker thread. A rendering longer than the messages plus ``TEMPLATE_OVERHEAD_CHARS`` (and
    ``TEMPLATE_OVERHEAD_PER_MESSAGE`` per message) is refused with a ``ValueError`` naming ``chat_template_kwargs``.
    """
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )
    bound = sum(len(m["content"]) for m in messages) + TEMPLATE_OVERHEAD_CHARS \
        + TEMPLATE_OVERHEAD_PER_MESSAGE * len(messages)
    if len(text) > bound:
        raise ValueError(f"the chat template rendered {len(text)} characters from messages allowing at most {bound}; "
                         "'chat_template_kwargs' must not expand the prompt")
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def user_context(messages: list[dict]) -> str:
    """Concatenated user-role messages (CLaaS paper App.: the grader's context), separated by blank lines."""
    return "\n\n".join(m["content"] for m in messages if m["role"] == "user")
