"""Peak memory per rank of continual MOPD at 003's recipe sizes, from the code's allocation pattern (issue 12).

    python benchmarks/mopd_memory_table.py            # the README table (1.7B and 8B students)
    python benchmarks/mopd_memory_table.py --check    # + a CPU measurement at a reduced size against the formulas

Setting (SPEC B.1, B.7, ``recipes/mopd/verl/gpu.yaml``): 4 ranks, FSDP2 full sharding, fp32 master weights with bf16
compute, fp32 gradients, AdamW; 128 responses per step = 32 per rank; prompt <= 2,048 and response <= 16,384
tokens, so a full-length sequence has 18,432 tokens (the key axis of the pooled rows); dynamic micro-batches of
<= 24,576 tokens (``ppo_max_token_len_per_gpu``), i.e. one full-length response per micro-batch for the token pass
and (``--align-rows``, default 1) the alignment passes; gradient checkpointing on; FSAR aligns all layers with
W = 2,000 and ``--regions`` reasoning steps in the window (default 21, which gives 003's ~0.75 GB of targets per
response at 18.4k keys for the 1.7B shape). Teachers: same shape as the student, fp32 weights offloaded to the host
(``param_offload``), bf16 compute.

What each row counts (bytes; P = parameters, R = ranks, N = tokens of one micro-batch; D, L, H, G, d, F (MLP
size), V the model shape):

* params: fp32 master shard ``4P/R`` + the bf16 all-gathered working copy of the root (embedding and, untied, the
  LM head; ``2VD`` each) and of two decoder layers (the one running and the prefetched one);
* grads: fp32 shard ``4P/R``; optimizer: AdamW ``8P/R``;
* balancing vectors (replay steps of FSAR): ``--grad-copies`` extra fp32 gradient shards on the device. The
  worker's ``HostBalancer`` keeps g_tok and u on the host and the combination is written into ``.grad`` in place,
  so the default is 0 (plus one parameter shard in transit, <= 0.62 GiB at 8B, not counted); the earlier layout
  held 6 (g_tok, g_sats, g_vr, g_hid, g_aux, g): ``--grad-copies 6`` shows it;
* activations, token pass: checkpointed layer inputs ``2·L·N·D`` + one layer recomputed in the backward
  ``2·N·(2Hd + 2Gd + 2D + 3F)`` (q, k, v, attention out, o, the norms' outputs, gate, up, act·up; flash attention);
* logits chunks, token pass: the bf16 logits ``2NV``, their bf16 gradient ``2NV`` (allocated once by the chunked
  backward) and ``1.5`` fp32 ``[chunk, V]`` temporaries (chunk 1,024; the factor is measured by
  ``benchmarks/bench_topk_chunked.py``);
* alignment pass (one term, the largest: SATS): checkpointed layer inputs, one layer recomputed in the backward,
  the captured bf16 q/k outputs and their post-RoPE copies of every aligned layer ``2·2·N·(Hd+Gd)·|L|``, the
  fp32 pooled rows kept for the loss ``4·|L|·H·R·Tk`` per response, ~5 fp32 ``[H, 256, Tk]`` temporaries of one
  query chunk of the pooled rows, the device copy of that micro-batch's bf16 targets; no logits (``logits=False``);
* teacher forward: the log-prob pass has the same logits chunks as the token pass minus the gradient; the target
  pass (no logits) holds every aligned layer's captured q/k/v ``2·N·(H+2G)·d·|L|`` and fp32 rows of all terms;
* teacher targets (host RAM): ``target_bytes`` per response, kept up to ``mopd.signal.target_budget_gib``
  (default 16 GiB; the rest is streamed, :class:`claas_verl.align.TeacherTargetStore`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool

    @property
    def layer_params(self) -> int:
        D, H, G, d, F = self.hidden, self.heads, self.kv_heads, self.head_dim, self.mlp
        return D * H * d + 2 * D * G * d + H * d * D + 3 * D * F + 2 * D + 2 * d

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params


QWEN3_1_7B = Shape("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151_936, True)
QWEN3_8B = Shape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151_936, False)


@dataclasses.dataclass(frozen=True)
class Run:
    ranks: int = 4
    responses_per_rank: int = 32
    seq: int = 18_432  # prompt 2,048 + response 16,384
    mb_tokens: int = 18_432  # one full-length response per micro-batch (<= 24,576 tokens per GPU)
    align_rows: int = 1
    window: int = 2000
    regions: int = 21
    chunk: int = 1024
    grad_copies: int = 0
    target_budget_gib: float = 16.0
    chunk_temp_factor: float = 1.5  # fp32 [chunk, V] temporaries alive at the peak (measured)
    pool_chunk: int = 256  # query rows per chunk of the pooled attention rows
    pool_temp_factor: float = 5.0  # fp32 [H, chunk, Tk] temporaries of one chunk (scores, mask, probs, grads)


def target_bytes_per_response(s: Shape, r: Run, terms=("sats", "vr", "hidden")) -> int:
    """Same formula as claas_verl.align.target_bytes for one full-length response, all layers aligned."""
    per_head = s.layers * r.regions * r.seq
    n = per_head * (s.heads * ("sats" in terms) + s.kv_heads * ("vr" in terms))
    n += s.layers * r.window * s.hidden * ("hidden" in terms)
    return 2 * n


def table(s: Shape, r: Run) -> dict[str, float]:
    """Peak bytes per rank of each component (see the module docstring)."""
    P, R, N, V, D, L = s.params, r.ranks, r.mb_tokens, s.vocab, s.hidden, s.layers
    H, G, d, F = s.heads, s.kv_heads, s.head_dim, s.mlp
    out: dict[str, float] = {}
    gathered = 2 * s.root_params + 2 * 2 * s.layer_params
    out["params (fp32 shard + bf16 gathered root and 2 layers)"] = 4 * P / R + gathered
    out["grads (fp32 shard)"] = 4 * P / R
    out["optimizer (AdamW, fp32 shard)"] = 8 * P / R
    out["balancing vectors (fp32 shards)"] = r.grad_copies * 4 * P / R
    ckpt = 2 * L * N * D
    out["activations, token pass"] = ckpt + 2 * N * (2 * H * d + 2 * G * d + 2 * D + 3 * F)
    out["logits chunks, token pass"] = 2 * N * V * 2 + r.chunk_temp_factor * r.chunk * V * 4
    na = r.align_rows * r.seq
    rows = 4 * L * H * r.regions * r.seq * r.align_rows
    tgt = target_bytes_per_response(s, r, ("sats",)) * r.align_rows
    recompute = 2 * na * (2 * H * d + 2 * G * d + 2 * D + 3 * F)
    pool_chunk = r.pool_temp_factor * 4 * r.align_rows * H * r.pool_chunk * r.seq
    out["activations, alignment pass (SATS)"] = (2 * L * na * D + recompute + 2 * 2 * na * (H * d + G * d) * L + rows
                                                 + pool_chunk + tgt)
    teacher_rows = 4 * L * (H + G) * r.regions * r.seq * r.align_rows + 4 * L * r.window * D * r.align_rows
    out["teacher forward (max of log-prob and target pass)"] = max(
        2 * N * V + r.chunk_temp_factor * r.chunk * V * 4,
        2 * na * (H + 2 * G) * d * L + teacher_rows,
    )
    per_resp = target_bytes_per_response(s, r)
    out["teacher targets, host RAM (bounded)"] = min(r.responses_per_rank * per_resp,
                                                      max(math.floor(r.target_budget_gib * GiB / per_resp), 0)
                                                      * per_resp + per_resp / 3)
    out["_per_response_targets"] = per_resp
    out["_unbounded_targets"] = r.responses_per_rank * per_resp
    return out


def peaks(t: dict[str, float]) -> dict[str, float]:
    """Device peaks of the three phases of a replay step (components alive together)."""
    state = sum(t[k] for k in t if k.startswith(("params", "grads", "optimizer")))
    bal = t["balancing vectors (fp32 shards)"]
    return {
        "token pass": state + t["activations, token pass"] + t["logits chunks, token pass"],
        "alignment pass": state + bal + t["activations, alignment pass (SATS)"],
        "teacher forward": state + t["teacher forward (max of log-prob and target pass)"],
    }


def print_table(run: Run) -> None:
    shapes = (QWEN3_1_7B, QWEN3_8B)
    tabs = {s.name: table(s, run) for s in shapes}
    print(f"MOPD peak memory per rank, GiB: {run.ranks} ranks, {run.responses_per_rank} responses per rank, "
          f"{run.seq:,}-token sequences, micro-batch {run.mb_tokens:,} tokens, alignment rows {run.align_rows}, "
          f"W = {run.window}, {run.regions} regions, {run.grad_copies} balancing copies")
    print(f"{'component':58s}" + "".join(f"{s.name:>12s}" for s in shapes))
    for k in tabs[shapes[0].name]:
        if not k.startswith("_"):
            print(f"{k:58s}" + "".join(f"{tabs[s.name][k] / GiB:12.1f}" for s in shapes))
    for phase in ("token pass", "alignment pass", "teacher forward"):
        print(f"{'peak, ' + phase + ' (device)':58s}" + "".join(f"{peaks(tabs[s.name])[phase] / GiB:12.1f}"
                                                                 for s in shapes))
    for s in shapes:
        t = tabs[s.name]
        print(f"{s.name}: {s.params / 1e9:.2f}B params; teacher targets {t['_per_response_targets'] / GiB:.2f} GiB "
              f"per response, {t['_unbounded_targets'] / GiB:.1f} GiB per rank unbounded")


# ----------------------------------------------------------------------------------------------------------------
# CPU check at a reduced size


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def check() -> None:
    """Measure the token-pass logits chunks and the SATS alignment pass at a reduced size, in child processes."""
    import subprocess
    import sys

    for part in ("logits", "sats", "teacher_logits", "teacher_nologits"):
        out = subprocess.run([sys.executable, __file__, "--child", part], check=True, capture_output=True, text=True)
        print(out.stdout.strip())


def child(part: str) -> None:
    import resource

    import torch

    torch.set_num_threads(1)
    if part == "logits":
        from claas_verl.distill import topk_distill_loss

        s = dataclasses.replace(QWEN3_1_7B, vocab=151_936)
        run = Run(mb_tokens=4096)
        N, V = run.mb_tokens, s.vocab
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, V, (1, N, 16), generator=g)
        adv, mask = torch.randn(1, N, 16, generator=g), torch.ones(1, N)
        base = _rss()
        logits = torch.empty(1, N, V, dtype=torch.bfloat16).normal_(generator=g).requires_grad_(True)
        topk_distill_loss(logits, ids, adv, mask, chunk_size=run.chunk).backward()
        measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        predicted = table(s, run)["logits chunks, token pass"]
        print(f"check logits chunks, token pass (N = {N}, V = {V}): predicted {predicted / 2**20:.0f} MiB, "
              f"measured {measured / 2**20:.0f} MiB ({measured / predicted:.2f}x)")
        return
    # SATS pass of a reduced Qwen3 (fp32 on CPU: byte counts scale 2x for the bf16 terms of the formula)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from claas_verl.align import alignment_losses, alignment_signals, step_regions

    s = Shape("reduced", 4, 512, 8, 4, 64, 1536, 151_936, True)
    run = Run(seq=4096, mb_tokens=4096, window=1024, regions=16)
    cfg = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                      vocab_size=s.vocab, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    T, P = run.seq, 64
    ids = torch.randint(10, 1000, (1, T))
    step = (run.window // run.regions)
    ids[0, T - run.window + step - 1::step] = 7
    am = torch.ones_like(ids)
    reg = step_regions(ids[:, P:], am[:, P:], {7}, window=run.window).pad_left(P)
    assert int(reg.num_regions.max()) == run.regions, int(reg.num_regions.max())
    if part.startswith("teacher"):
        # the teacher target forward (FSAR, all terms, no grad) with and without the unused [B, T, V] logits
        keep = part == "teacher_logits"
        base = _rss()
        with torch.no_grad():
            out, sig = alignment_signals(model, ids, am, reg, pooled_layers=range(s.layers),
                                         hidden_layers=range(s.layers), logits=keep)
            targets = sig.as_targets()
        measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        print(f"teacher target forward ({T} tokens, V = {s.vocab}, bf16), logits={keep}: peak {measured / 2**20:.0f} "
              f"MiB above the model (logits {tuple(out.logits.shape)}, {2 * out.logits.numel() / 2**20:.0f} MiB)")
        return
    with torch.no_grad():
        _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=range(s.layers),
                                   hidden_layers=range(s.layers), logits=False)
        targets = sig.as_targets()
        del sig
    base = _rss()
    _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=range(s.layers),
                               hidden_layers=range(s.layers), logits=False)
    alignment_losses(sig, targets, reg)["sats"].loss.backward()
    measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    predicted = table(s, run)["activations, alignment pass (SATS)"] - target_bytes_per_response(s, run, ("sats",))
    grads = 2 * s.params  # the bf16 gradient of every parameter (not part of the activation row)
    total = predicted + grads
    print(f"check SATS alignment pass ({s.layers} layers, hidden {s.hidden}, {T} tokens, {run.regions} regions, "
          f"bf16, checkpointing): predicted activations {predicted / 2**20:.0f} MiB + grads {grads / 2**20:.0f} MiB "
          f"= {total / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB ({measured / total:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--child", default="")
    ap.add_argument("--grad-copies", type=int, default=Run.grad_copies)
    ap.add_argument("--align-rows", type=int, default=Run.align_rows)
    ap.add_argument("--regions", type=int, default=Run.regions)
    ap.add_argument("--target-budget-gib", type=float, default=Run.target_budget_gib)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    print_table(Run(grad_copies=args.grad_copies, align_rows=args.align_rows, regions=args.regions,
                    target_budget_gib=args.target_budget_gib))
    if args.check:
        check()


if __name__ == "__main__":
    main()
