"""The tiny Qwen2 student and its per-domain experts.

Student: a randomly initialised ``Qwen2ForCausalLM`` (hidden 64, 4 layers, 4 heads, 2 KV
heads, tied embeddings, float32), about 0.2 M parameters, seeded with ``torch.manual_seed``.

Expert of domain d (the "teacher" of MOPD stage d): the student plus a seeded task vector

    θ_E = θ_S + τ_d,   ‖τ_d[p]‖ = rel_norm · ‖θ_S[p]‖  for every parameter tensor p,

with τ_d[p] ∝ Gaussian noise drawn from a generator seeded by a SHA-256 of (seed, d), so
experts are deterministic, differ per domain, and sit close to the student (distillation
can close the gap in a few steps). On top, the expert *prefers* a few domain marker tokens:
their (tied) output-embedding rows move along the mean final hidden state of the expert on
the domain's prompts, which raises their logits by about ``marker_logit_boost`` there. The
student's probability of those markers is thus a cheap forgetting probe.

A tensor that is zero in the student (the attention biases at init) stays zero: a relative
size has no meaning there.

Measured for seed 0 (tests/tiny/test_tiny_model.py): student→expert KL on domain test prompts
0.05–0.08 nats/token; five AdamW steps at lr 3e-4 on KL(expert‖student) halve it (0.085 → 0.038
on code); larger Adam steps overshoot at first (lr 1e-3: 0.085 → 0.119 → … → 0.053 by step 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from claas_verl.tiny.data import stable_seed

if TYPE_CHECKING:
    import torch

TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so that the random student's next-token distributions are not
    # almost uniform: student→expert KLs are then clearly measurable.
    initializer_range=0.1,
    use_sliding_window=False,
)

# Words each expert prefers (the first token of " word" in the tiny tokenizer is boosted).
DOMAIN_MARKERS: dict[str, tuple[str, ...]] = {
    "logic": (" Therefore", " Answer"),
    "math": (" answer", " boxed"),
    "code": (" prints", "```"),
    "safety": (" sorry", " can't"),
    "if": (" Done", " word"),
}


def student_config(vocab_size: int, eos_token_ids: Sequence[int], pad_token_id: int):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_token_ids[0],
        pad_token_id=pad_token_id,
        **TINY_ARCH,
    )
    cfg.dtype = "float32"
    return cfg


def build_student(vocab_size: int, eos_token_ids: Sequence[int], pad_token_id: int, seed: int):
    """A freshly initialised float32 tiny Qwen2 (deterministic in ``seed``) in eval mode."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(student_config(vocab_size, eos_token_ids, pad_token_id)).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id
    )
    return model.eval()


def marker_token_ids(tokenizer, domain: str) -> list[int]:
    """First token id of each marker word of ``domain`` (deduplicated, in marker order)."""
    ids: list[int] = []
    for word in DOMAIN_MARKERS.get(domain, ()):
        tid = tokenizer.encode(word, add_special_tokens=False)[0]
        if tid not in ids:
            ids.append(tid)
    return ids


def make_expert(student, domain: str, seed: int, rel_norm: float, marker_ids: Sequence[int] = (),
                prompt_ids: Sequence[Sequence[int]] = (), marker_logit_boost: float = 2.0):
    """Return a new model: ``student`` + the seeded task vector of ``domain`` (+ marker boost).

    Args:
        student: the tiny student (left unchanged).
        domain: name hashed into the task-vector seed.
        seed: the build seed.
        rel_norm: ‖τ[p]‖ / ‖θ_S[p]‖ per parameter tensor.
        marker_ids: token ids the expert should prefer.
        prompt_ids: tokenised domain prompts used to find the mean final hidden state.
        marker_logit_boost: approximate logit increase of each marker at those prompts.
    """
    import copy

    import torch

    if rel_norm < 0:
        raise ValueError(f"rel_norm={rel_norm} must be >= 0")
    expert = copy.deepcopy(student).eval()
    gen = torch.Generator().manual_seed(stable_seed("claas_tiny.expert", seed, domain))
    with torch.no_grad():
        # named_parameters() yields a tied tensor once; sorted names fix the draw order.
        for _, p in sorted(expert.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_(noise * (rel_norm * p.norm() / noise.norm().clamp_min(1e-12)))
        if marker_ids and len(prompt_ids) and marker_logit_boost:
            h = _mean_final_hidden(expert, prompt_ids)
            # Logit of token t is h·e_t; adding c·h/‖h‖² to e_t adds ≈ c at hidden states near h.
            # Tied embeddings: the same rows are also the markers' input embeddings (a small,
            # harmless change to how the expert reads those tokens).
            emb = expert.get_output_embeddings().weight
            for tid in marker_ids:
                emb[tid].add_(h * (marker_logit_boost / h.pow(2).sum().clamp_min(1e-12)))
    return expert


def _mean_final_hidden(model, prompt_ids) -> torch.Tensor:
    import torch

    states = []
    for ids in prompt_ids:
        out = model.model(input_ids=torch.tensor([list(ids)]))
        states.append(out.last_hidden_state[0])
    return torch.cat(states).mean(0)


def save_model(model, tokenizer, out_dir: Path) -> None:
    """Save weights (safetensors), config, generation config and the tokenizer files."""
    from transformers.utils import logging as hf_logging

    out_dir.mkdir(parents=True, exist_ok=True)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per model is noise in test logs
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)
