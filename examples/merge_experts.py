"""Merge the tiny experts without training (docs/math.md §B.10) and compare each merge's KL to every expert with the
student's.

    python examples/merge_experts.py [--tiny-dir DIR] [--density 0.2] [--n-prompts 8]

Builds (or reuses) the offline tiny bundle (``claas_verl.tiny.ensure_tiny``), merges its five
experts with TIES of the experts, stage-by-stage TIES (bf16 stages) and the uniform average,
and prints, for each expert E_d, the mean token-level KL(E_d ‖ model) on E_d's own test
prompts (teacher-forced next-token distributions over the chat-formatted prompt).

What to expect on the tiny bundle: its task vectors are independent dense Gaussian noise
(plus a small marker-token boost), the case least favourable to TIES. Trimming keeps each
expert's largest 20% of entries and the disjoint mean does not shrink them, so TIES ends
FARTHER from every expert than the student, while the uniform average (which shrinks
uncorrelated noise by 1/5) ends closer. Real experts fine-tuned from one student share
structure, which TIES exploits (MOPD paper: TIES of the experts is the best row). The same merges
on real checkpoints:
``python -m claas_verl.mopd.merges ties --base STUDENT --models E1 ... E5 --out OUT [--stagewise]``.
"""

from __future__ import annotations

import argparse

import torch


def prompt_batches(tokenizer, parquet_path, n_prompts):
    import pandas as pd

    rows = pd.read_parquet(parquet_path)["prompt"].tolist()[:n_prompts]
    texts = [tokenizer.apply_chat_template(list(r), add_generation_prompt=True, tokenize=False) for r in rows]
    return [torch.tensor([tokenizer.encode(t, add_special_tokens=False)]) for t in texts]


@torch.no_grad()
def mean_kl(teacher, student, batches) -> float:
    """Mean over prompt positions of KL(teacher ‖ student) of the next-token distributions (fp32)."""
    total, n = 0.0, 0
    for ids in batches:
        lt = torch.log_softmax(teacher(ids).logits.float(), -1)
        ls = torch.log_softmax(student(ids).logits.float(), -1)
        total += (lt.exp() * (lt - ls)).sum(-1).sum().item()
        n += ids.numel()
    return total / n


def main() -> None:
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from claas_verl.mopd.merges import SafetensorsDir, ties_merge, ties_stagewise, uniform_average
    from claas_verl.tiny import MOPD_DOMAINS, ensure_tiny

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-dir", default=None, help="tiny bundle directory (default $CLAAS_TINY_DIR or /tmp)")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--n-prompts", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()

    tiny = ensure_tiny(args.tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny.student)
    base = SafetensorsDir(tiny.student)
    expert_sd = [SafetensorsDir(tiny.experts[d]) for d in MOPD_DOMAINS]

    def model_with(state):
        m = Qwen2ForCausalLM.from_pretrained(tiny.student, dtype=torch.float32).eval()
        # strict=False only because the tied lm_head is not stored separately; report anything else
        missing, unexpected = m.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if unexpected or any(k != "lm_head.weight" for k in missing):
            raise RuntimeError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
        return m

    candidates = {
        "student": Qwen2ForCausalLM.from_pretrained(tiny.student, dtype=torch.float32).eval(),
        "TIES(experts)": model_with(ties_merge(base, expert_sd, args.density)),
        "TIES stage-by-stage": model_with(ties_stagewise(base, expert_sd, args.density)),
        "uniform average": model_with(uniform_average(expert_sd)),
    }
    experts = {d: Qwen2ForCausalLM.from_pretrained(tiny.experts[d], dtype=torch.float32).eval() for d in MOPD_DOMAINS}
    batches = {d: prompt_batches(tokenizer, tiny.test[d], args.n_prompts) for d in MOPD_DOMAINS}

    print(f"KL(E_d ‖ model) on each domain's test prompts (nats/token; {args.n_prompts} prompts, density "
          f"{args.density})")
    print(f"{'model':<22}" + "".join(f"{d:>10}" for d in MOPD_DOMAINS) + f"{'mean':>10}")
    for name, model in candidates.items():
        kls = [mean_kl(experts[d], model, batches[d]) for d in MOPD_DOMAINS]
        print(f"{name:<22}" + "".join(f"{k:>10.4f}" for k in kls) + f"{sum(kls) / len(kls):>10.4f}")


if __name__ == "__main__":
    main()
