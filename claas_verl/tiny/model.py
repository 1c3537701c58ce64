"""The tiny Qwen2 (or Qwen3) student and its per-domain experts.

Student: a ``Qwen2ForCausalLM`` (hidden 64, 4 layers, 2 heads of size 32, 1 KV head, tied embeddings,
float32), about 0.2 M parameters; the ``qwen3`` variant (:data:`ARCHS`) is a ``Qwen3ForCausalLM`` of the same
shape, with the per-head q/k RMS norms Qwen3 adds to the attention path. Seeded with ``torch.manual_seed``
and then briefly pretrained (:func:`train_lm`, see ``build.PRETRAIN``) on the bundle's own chat corpus, so
its next-token distributions are peaked (top-4 mass ~0.8-0.95 on sampled answers) rather than near-uniform.

Expert of domain d (the "teacher" of MOPD stage d): a copy of the student fine-tuned on d's
train reference answers (response tokens only, ``build.EXPERT_FT``), so the task vector
τ_d = θ_E − θ_S is a real fine-tuning delta. Training is single-threaded with deterministic
kernels and seeded batch order, so builds are byte-identical. On top, the expert *prefers* a
few domain marker tokens: their (tied) output-embedding rows move along the mean final hidden
state of the expert on the domain's prompts, which raises their logits by about
``marker_logit_boost`` there. The student's probability of those markers is a cheap
forgetting probe.

Measured for seed 0 (tests/tiny/test_tiny_model.py): student→expert KL over domain prompt
positions 1.0-2.6 nats/token; five AdamW steps at lr 3e-4 on KL(expert‖student) on code
prompts: 4.02 → 1.70.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from claas_verl.utils.progress import Progress
from claas_verl.utils.prompt_rows import stable_seed

if TYPE_CHECKING:
    import torch

TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    # Head size 32 (2 heads of 64/2): vLLM's CPU attention kernels need head_dim >= 32 (16 is refused), and the
    # vLLM tests serve this student. One KV head keeps grouped-query attention and the parameter count of v2
    # (k/v projections stay 64 -> 32).
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so that the random student's next-token distributions are not
    # almost uniform: student→expert KLs are then clearly measurable.
    initializer_range=0.1,
    use_sliding_window=False,
)

# Architecture families of the bundle: ``claas_verl.tiny make DIR --arch qwen3`` builds the same bundle (data,
# tokenizer, training recipe) with a Qwen3 student and experts (q_norm/k_norm before RoPE, explicit head_dim).
ARCHS = ("qwen2", "qwen3")
DEFAULT_ARCH = "qwen2"


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not a tiny bundle architecture; choose one of {ARCHS}")
    return arch


def _arch_classes(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32})}
    return classes[check_arch(arch)]


# Words each expert prefers (the first token of " word" in the tiny tokenizer is boosted).
DOMAIN_MARKERS: dict[str, tuple[str, ...]] = {
    "logic": (" Therefore", " Answer"),
    "math": (" answer", " boxed"),
    "code": (" prints", "```"),
    "safety": (" sorry", " can't"),
    "if": (" Done", " word"),
}


def student_config(vocab_size: int, eos_token_ids: Sequence[int], pad_token_id: int, arch: str = DEFAULT_ARCH):
    """The student's config: :data:`TINY_ARCH` in ``arch``'s model family."""
    config_cls, _, extra = _arch_classes(arch)
    cfg = config_cls(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_token_ids[0],
        pad_token_id=pad_token_id,
        **TINY_ARCH,
        **extra,
    )
    cfg.dtype = "float32"
    return cfg


def build_student(vocab_size: int, eos_token_ids: Sequence[int], pad_token_id: int, seed: int,
                  arch: str = DEFAULT_ARCH):
    """A freshly initialised float32 tiny Qwen2 or Qwen3 (deterministic in ``seed``) in eval mode."""
    import torch
    from transformers import GenerationConfig

    _, model_cls, _ = _arch_classes(arch)
    torch.manual_seed(seed)
    model = model_cls(student_config(vocab_size, eos_token_ids, pad_token_id, arch)).to(torch.float32)
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


def make_expert(student, domain: str, seed: int, examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                steps: int, lr: float, batch_size: int, pad_token_id: int, marker_ids: Sequence[int] = (),
                prompt_ids: Sequence[Sequence[int]] = (), marker_logit_boost: float = 2.0):
    """Return a new model: ``student`` fine-tuned on ``domain``'s (prompt, reference) pairs,
    plus the marker boost. The task vector τ_d = θ_E − θ_S is thus a real fine-tuning delta.

    Args:
        student: the (pretrained) tiny student (left unchanged).
        domain: name hashed into the fine-tuning seed (batch order).
        seed: the build seed.
        examples: (prompt ids, reference-response ids) of the domain's train split.
        steps, lr, batch_size: AdamW fine-tuning on the response tokens (see :func:`train_lm`).
        pad_token_id: id used to pad batches (masked out).
        marker_ids: token ids the expert should prefer.
        prompt_ids: tokenised domain prompts used to find the mean final hidden state.
        marker_logit_boost: approximate logit increase of each marker at those prompts.
    """
    import copy

    import torch

    expert = copy.deepcopy(student)
    train_lm(expert, examples, steps, lr, batch_size, stable_seed("claas_tiny.expert", seed, domain),
             prompt_loss=False, pad_token_id=pad_token_id, label=f"[tiny] expert {domain}")
    with torch.no_grad():
        if marker_ids and len(prompt_ids) and marker_logit_boost:
            h = _mean_final_hidden(expert, prompt_ids)
            # Logit of token t is h·e_t; adding c·h/‖h‖² to e_t adds ≈ c at hidden states near h.
            # Tied embeddings: the same rows are also the markers' input embeddings (a small,
            # harmless change to how the expert reads those tokens).
            emb = expert.get_output_embeddings().weight
            for tid in marker_ids:
                emb[tid].add_(h * (marker_logit_boost / h.pow(2).sum().clamp_min(1e-12)))
    return expert


def train_lm(model, examples: Sequence[tuple[Sequence[int], Sequence[int]]], steps: int, lr: float,
             batch_size: int, seed: int, prompt_loss: bool, pad_token_id: int, label: str = "[tiny] training"):
    """Deterministic AdamW next-token training of ``model`` in place; returns the last loss.

    ``examples`` are (prompt ids, response ids) pairs; the loss covers response tokens, and
    prompt tokens too when ``prompt_loss``. Batches are drawn with a generator seeded by
    ``seed`` (sampling without replacement within a batch). Callers run this with one thread
    and ``torch.use_deterministic_algorithms(True)`` so the weights are byte-reproducible. Progress lines
    (``label``: step, ETA, loss) go to stderr.
    """
    import torch

    if steps < 0 or batch_size < 1 or not examples:
        raise ValueError(f"steps={steps}, batch_size={batch_size}, {len(examples)} examples: need >=0, >=1, >=1")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    progress = Progress(label, steps, "steps")
    for _ in range(steps):
        idx = torch.randperm(len(examples), generator=gen)[:batch_size].tolist()
        batch = [(list(examples[i][0]), list(examples[i][1])) for i in idx]
        width = max(len(a) + len(b) for a, b in batch)
        x = torch.full((len(batch), width), pad_token_id)
        att = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for row, (a, b) in enumerate(batch):
            seq = torch.tensor(a + b)
            x[row, : len(seq)] = seq
            att[row, : len(seq)] = 1
            start = 0 if prompt_loss else len(a)
            labels[row, start : len(seq)] = seq[start:]
        loss = model(input_ids=x, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress.update(loss=float(loss.detach()))
    model.eval()
    return float(loss.detach())


def _mean_final_hidden(model, prompt_ids) -> torch.Tensor:
    import torch

    states = []
    for ids in prompt_ids:
        out = model.model(input_ids=torch.tensor([list(ids)]))
        states.append(out.last_hidden_state[0])
    return torch.cat(states).mean(0)


def save_model(model, tokenizer, out_dir: Path) -> None:
    """Save weights (safetensors), config, generation config and the tokenizer files."""
    from claas_verl.utils.hf_quiet import hf_progress_bars_off

    out_dir.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
