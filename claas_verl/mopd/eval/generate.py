"""Sampling backends: vLLM on GPU (imported lazily) and Hugging Face ``generate`` on CPU.

Both take chat prompts (lists of messages), apply the model's own chat template (MOPD paper: every benchmark uses
it), and return per prompt ``n`` completions with a ``truncated`` flag (the response reached the max new
tokens), which the evaluation reports per benchmark (MOPD paper App. C, "Truncation and answer extraction").
"""

from __future__ import annotations

from dataclasses import dataclass

from claas_verl.utils.progress import Progress


@dataclass(frozen=True)
class Completion:
    text: str
    truncated: bool


class HFGenerator:
    """CPU path: ``transformers`` sampling, batched with left padding; seeded with ``torch.manual_seed``."""

    def __init__(self, model_path: str, batch_size: int = 8, max_new_tokens_cap: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.batch_size, self.cap = batch_size, max_new_tokens_cap

    def generate(self, prompts: list[list[dict]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Completion]]:
        import torch

        torch.manual_seed(seed)
        max_new = min(max_new_tokens, self.cap) if self.cap else max_new_tokens
        texts = [self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tok.eos_token_id])
        out: list[list[Completion]] = []
        progress = Progress("[eval] generate", len(texts), "prompts")
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i: i + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                seqs = self.model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p,
                                           max_new_tokens=max_new, num_return_sequences=n,
                                           pad_token_id=self.tok.pad_token_id)
            gen = seqs[:, enc["input_ids"].shape[1]:]
            for j in range(gen.shape[0] // n):
                row = []
                for g in gen[j * n: (j + 1) * n].tolist():
                    ended = next((k for k, t in enumerate(g) if t in eos), None)
                    toks = g if ended is None else g[:ended]
                    row.append(Completion(self.tok.decode(toks, skip_special_tokens=True), ended is None))
                out.append(row)
            progress.update(gen.shape[0] // n)
        return out


class VLLMGenerator:
    """GPU path. Every request carries ``seed`` (vLLM's per-request generator), so a response depends only on
    its prompt, the sample index and the evaluation seed, not on how requests are batched."""

    def __init__(self, model_path: str, max_model_len: int = 32768, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, max_new_tokens_cap: int | None = None):
        from vllm import LLM

        self.llm = LLM(model=model_path, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization, seed=0)
        self.cap = max_new_tokens_cap

    def generate(self, prompts: list[list[dict]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams

        max_new = min(max_new_tokens, self.cap) if self.cap else max_new_tokens
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new, seed=seed)
        outs = self.llm.chat(prompts, params, use_tqdm=False)
        return [[Completion(c.text, c.finish_reason == "length") for c in o.outputs] for o in outs]

    def close(self) -> None:
        del self.llm
