"""Peak memory per rank of continual MOPD at the MOPD paper's recipe sizes, from the code's allocation pattern.

    python benchmarks/mopd_memory_table.py            # the table of docs/performance.md (1.7B and 8B students)
    python benchmarks/mopd_memory_table.py --check    # + every row measured on CPU at a reduced size
    python benchmarks/mopd_memory_table.py --check --tiny   # the same check at test size (seconds)

Setting (docs/math.md §B.1, B.7, ``recipes/mopd/verl/gpu.yaml``): 4 ranks, FSDP2 full sharding, fp32 master weights with
bf16
compute, fp32 gradients, AdamW; 128 responses per step = 32 per rank; prompt <= 2,048 and response <= 16,384
tokens, so a full-length sequence has 18,432 tokens (the key axis of the pooled rows); dynamic micro-batches of
<= 24,576 tokens (``ppo_max_token_len_per_gpu``): the token pass holds up to 24,576 packed tokens, and the
alignment passes hold their micro-batch's rows padded to the longest one (``--align-rows``: 1 = a full-length
response alone; 2 = one with a shorter companion, padded to 2 x 18,432 positions); gradient checkpointing on; FSAR
aligns all layers with W = 2,000 and ``--regions`` reasoning steps in the window (default 21, which gives the MOPD
paper's
~0.75 GB of targets per response at 18.4k keys for the 1.7B shape). Teachers: same shape as the student, fp32
weights offloaded to the host (``param_offload``), gathered per layer, bf16 compute.

What each row counts (bytes; P = parameters, R = ranks, N = tokens of the token pass's micro-batch, Na = rows x
sequence of an alignment micro-batch; D, L, H, G, d, F (MLP size), V the model shape; a "layer's saved tensors"
is what one Qwen3 decoder layer keeps for its backward per token: ``16D + 10Hd + 10Gd + 8F + 8H + 4G + 8`` bytes,
i.e. the two RMSNorms' fp32 input, bf16 normalised copy and output, the q/k norms' fp32 input and bf16 normalised
copy, post-RoPE q/k, v, the attention output and its logsumexp, and the MLP's gate, act, up and product):

* params: fp32 master shard ``4P/R`` + the bf16 all-gathered root (embedding, final norm and, untied, the LM head)
  and two decoder layers (the one running and the prefetched one);
* grads: fp32 shard ``4P/R``; optimizer: AdamW ``8P/R``, and in its step one more fp32 ``4P/R`` (the foreach
  implementation's ``sqrt(v)`` for every parameter at once: the "optimizer step" peak);
* balancing on the device: ``--grad-copies`` extra fp32 gradient shards (0: :class:`HostBalancer` keeps g_tok and
  u on the host) + the largest parameter's fp32 shard in transit to the host;
* activations, token pass: checkpointed layer inputs ``2·L·N·D`` and the RoPE tables, one layer recomputed in the
  backward (its saved tensors) and the gradients in flight through it ``2·N·(F+D)``;
* logits chunks, token pass: the bf16 logits ``2NV``, their bf16 gradient ``2NV`` and ``1.5`` fp32 ``[chunk, V]``
  temporaries (chunk 1,024);
* the token pass's peak is not the sum of its two rows: the logits' gradient is freed once the LM head's backward
  has consumed it, before any decoder layer is recomputed. Its backward peaks in one of three moments, each on top
  of the params, grads and optimizer rows: (A) the LM head's backward: the checkpointed layer inputs + the logits
  row + the head's unsharded bf16 weight gradient ``2VD``; (B) a decoder layer recomputed: the layer inputs + the
  logits ``2NV`` (held by the loss's caller until the backward returns) + one layer's backward + ``2VD``; (C) the
  root's gradient reduction, the layer inputs freed: ``2NV`` + the root's unsharded bf16 gradients
  (:func:`token_pass_backward`). With several ranks FSDP2's fp32 reduce-scatter input for the root (``4·root``)
  comes on top of C; one rank does not show it, so it is not modelled (at the 8B shape C stays below A even with
  it). Measured on an H200 (``make gpu-check``): the sum over-stated an 8B-width token pass by 56% (25.0 GiB
  against 16.0);
* activations, alignment pass (SATS, the largest term): checkpointed layer inputs, the captured q/k/v projections
  of every aligned layer ``2·Na·(H+2G)·d·|L|`` (the post-RoPE copies are recomputed in the backward, layer by
  layer), the fp32 pooled rows ``4·|L|·b·H·R·Tk`` with their saved difference to the target and their gradient,
  the device copy of the bf16 targets, the final norm's saved tensors (the last hidden state gets a zero
  gradient so that the last layer's recomputation is consumed), and the larger of one decoder layer recomputed as
  in the token pass and one layer's post-RoPE q/k with ~3 fp32 ``[b, H, 256, Tk]`` temporaries of one query
  chunk; no logits (``logits=False``). A streamed micro-batch's teacher forward runs before the student's forward,
  never inside it;
* teacher forward: the gathered fp32 teacher root + two layers, then the larger of the log-prob pass (bf16 logits
  ``2NV`` + fp32 chunk temporaries) and the target pass (every layer's hidden state ``2·(L+1)·Na·D``, the captured
  q/k/v, the fp32 SATS/VR rows of every layer, then the larger of one query chunk's 2 fp32 temporaries and the
  bf16 target copies);
* teacher targets (host RAM): ``target_bytes`` per response, kept up to ``mopd.signal.target_budget_gib``
  (default 16 GiB; the rest is streamed, :class:`claas_verl.align.TeacherTargetStore`);
* host balancing buffers: g_tok and u, one fp32 host tensor per parameter shard each, pinned on CUDA, where the
  caching host allocator rounds every allocation up to a power of two.

``--check`` builds a Qwen3 of a reduced shape and measures every row with
:class:`claas_verl.utils.live_bytes.LiveBytes` (exact bytes of the tensors the code allocates, forward and
backward): the state rows from the real parameter, gradient, optimizer and balancing buffers, the passes by running
them (bf16, gradient checkpointing, SATS on all layers). It fails unless every row is within 15% of its formula.
The device-side transit copy of the balancing row exists only on a GPU (``make gpu-check`` measures it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

GiB = 2**30
TOLERANCE = 0.15


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

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter of the HF Qwen3 causal LM of this shape."""
        D, H, G, d, F, V = self.hidden, self.heads, self.kv_heads, self.head_dim, self.mlp, self.vocab
        layer = [(H * d, D), (G * d, D), (G * d, D), (D, H * d), (d,), (d,), (F, D), (F, D), (D, F), (D,), (D,)]
        return [(V, D), *layer * self.layers, (D,), *([] if self.tied else [(V, D)])]

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

    def layer_saved_per_token(self) -> int:
        """Bytes one bf16 Qwen3 decoder layer saves for its backward per token (see the module docstring)."""
        D, H, G, d, F = self.hidden, self.heads, self.kv_heads, self.head_dim, self.mlp
        return 16 * D + 10 * H * d + 10 * G * d + 8 * F + 8 * H + 4 * G + 8


QWEN3_1_7B = Shape("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151_936, True)
QWEN3_8B = Shape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151_936, False)


@dataclasses.dataclass(frozen=True)
class Run:
    ranks: int = 4
    responses_per_rank: int = 32
    seq: int = 18_432  # prompt 2,048 + response 16,384
    mb_tokens: int = 24_576  # ppo_max_token_len_per_gpu: packed tokens of one token-pass micro-batch
    align_rows: int = 1  # rows of an alignment micro-batch, each padded to `seq`
    window: int = 2000
    regions: int = 21
    chunk: int = 1024
    grad_copies: int = 0
    target_budget_gib: float = 16.0
    chunk_temp_factor: float = 1.5  # fp32 [chunk, V] temporaries alive at the peak of the top-k loss
    pool_chunk: int = 256  # query rows per chunk of the pooled attention rows
    pool_temp_factor: float = 3.0  # fp32 [b, H, chunk, Tk] temporaries of one chunk in its backward
    pinned_pow2: bool = True  # CUDA's caching host allocator rounds each pinned allocation up to a power of two


def target_bytes_per_response(s: Shape, r: Run, terms=("sats", "vr", "hidden")) -> int:
    """Same formula as claas_verl.align.target_bytes for one full-length response, all layers aligned."""
    per_head = s.layers * r.regions * r.seq
    n = per_head * (s.heads * ("sats" in terms) + s.kv_heads * ("vr" in terms))
    n += s.layers * r.window * s.hidden * ("hidden" in terms)
    return 2 * n


def _shard(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of one rank's FSDP2 shard (dim 0 split into ``ranks`` equal, padded chunks)."""
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _layer_backward(s: Shape, n: int, layers: int = 1) -> int:
    """``layers`` checkpointed decoder layers recomputed in the backward + the gradients in flight through one."""
    return layers * n * s.layer_saved_per_token() + 2 * n * (s.mlp + s.hidden)


def token_pass_backward(s: Shape, r: Run, first_micro_batch: bool = False) -> float:
    """Peak bytes of the token pass's backward above the params, optimizer and (see below) grads rows.

    The max of the three moments of the module docstring. With ``first_micro_batch`` the fp32 gradient shards are
    not yet there when the backward starts: the layers' shards appear as their layers finish (B) and the root's at
    its reduction (C), so they are counted inside the moments (``make gpu-check``'s single micro-batch); otherwise
    (a step of several micro-batches) the whole grads row is alive throughout and counted outside.
    """
    N, V, D, R = r.mb_tokens, s.vocab, s.hidden, r.ranks
    inputs = 2 * s.layers * N * D + 2 * 2 * N * s.head_dim  # checkpointed layer inputs + RoPE tables
    logits_row = 2 * N * V * 2 + r.chunk_temp_factor * r.chunk * V * 4
    head_grad = 2 * V * D  # the LM head's (or the tied embedding's) unsharded bf16 gradient, freed at C
    layer_grads = 4 * s.layers * s.layer_params / R if first_micro_batch else 0
    all_grads = 4 * s.params / R if first_micro_batch else 0
    return max(
        inputs + logits_row + head_grad,  # A: the LM head's backward
        inputs + 2 * N * V + _layer_backward(s, N) + head_grad + layer_grads,  # B: a layer recomputed
        2 * N * V + 2 * s.root_params + all_grads,  # C: the root's gradient reduction
    )


def table(s: Shape, r: Run) -> dict[str, float]:
    """Peak bytes per rank of each component (see the module docstring)."""
    P, R, N, V, D, L = s.params, r.ranks, r.mb_tokens, s.vocab, s.hidden, s.layers
    H, G, d = s.heads, s.kv_heads, s.head_dim
    out: dict[str, float] = {}
    gathered = 2 * s.root_params + 2 * 2 * s.layer_params
    out["params (fp32 shard + bf16 gathered root and 2 layers)"] = 4 * P / R + gathered
    out["grads (fp32 shard)"] = 4 * P / R
    out["optimizer (AdamW, fp32 shard)"] = 8 * P / R
    transit = 4 * max(_shard(p, R) for p in s.param_shapes())
    out["balancing on the device (fp32 shards + one in transit)"] = r.grad_copies * 4 * P / R + transit
    rope = 2 * 2 * N * d
    out["activations, token pass"] = 2 * L * N * D + rope + _layer_backward(s, N)
    out["logits chunks, token pass"] = 2 * N * V * 2 + r.chunk_temp_factor * r.chunk * V * 4
    b, T = r.align_rows, r.seq
    na = b * T
    rows = L * b * H * r.regions * T  # SATS row elements (key axis ~ the whole sequence)
    raw = 2 * na * (H + 2 * G) * d * L
    chunk = min(r.pool_chunk, r.window)
    final_norm = 8 * na * D  # kept for the zero gradient that lets the last layer's recomputation be consumed
    # the backward's peak: one decoder layer recomputed, or (earlier) one layer's post-RoPE q/k recomputed with
    # one query chunk's fp32 temporaries
    chunk_phase = 3 * 2 * na * (H + G) * d + r.pool_temp_factor * 4 * b * H * chunk * T
    out["activations, alignment pass (SATS)"] = (2 * L * na * D + 2 * 2 * na * d + raw + 3 * 4 * rows + 2 * rows
                                                 + final_norm + max(_layer_backward(s, na), chunk_phase))
    teacher_params = 4 * s.root_params + 2 * 4 * s.layer_params
    teacher_rows = L * b * (H + G) * r.regions * T
    window = L * b * r.window * D
    # no grad: every layer's hidden state, the captured projections and one layer's post-RoPE q/k, then the
    # larger of (the last layer's query chunk: 2 fp32 [b, H, C, Tk] temporaries) and (the targets' bf16 copies)
    common = 2 * (L + 1) * na * D + 2 * 2 * na * d + raw + 4 * teacher_rows
    target_pass = common + max(2 * na * (H + G) * d + 2 * 4 * b * H * chunk * T, 2 * (teacher_rows + window))
    logprob_pass = 2 * N * V + r.chunk_temp_factor * r.chunk * V * 4
    out["teacher forward (gathered fp32 params + max of log-prob and target pass)"] = (
        teacher_params + max(logprob_pass, target_pass))
    per_resp = target_bytes_per_response(s, r)
    out["teacher targets, host RAM (bounded)"] = min(r.responses_per_rank * per_resp,
                                                      max(math.floor(r.target_budget_gib * GiB / per_resp), 0)
                                                      * per_resp + per_resp / 3)
    host = [4 * _shard(p, R) for p in s.param_shapes()]
    out["balancing buffers g_tok and u, host RAM (pinned)"] = 2 * sum(_pow2(n) if r.pinned_pow2 else n for n in host)
    out["_per_response_targets"] = per_resp
    out["_unbounded_targets"] = r.responses_per_rank * per_resp
    out["_token_pass_backward"] = token_pass_backward(s, r)
    out["_optimizer_step_temp"] = 4 * P / R  # AdamW (foreach): sqrt(exp_avg_sq) of every parameter at once
    out["_token_pass_logprob"] = logprob_pass
    out["_target_pass"] = target_pass
    out["_teacher_params"] = teacher_params
    out["_vr_rows"] = 14 * L * b * G * r.regions * T  # VR's rows as SATS's (3 fp32 + 1 bf16 copies), G heads
    return out


STATE = ("params", "grads", "optimizer")


def peaks(t: dict[str, float]) -> dict[str, float]:
    """Device peaks of the four phases of a replay step (components alive together)."""
    state = sum(t[k] for k in t if k.startswith(STATE))
    return {
        "token pass": state + t["_token_pass_backward"],
        "alignment pass": state + t["balancing on the device (fp32 shards + one in transit)"]
        + t["activations, alignment pass (SATS)"],
        "teacher forward": state + t["teacher forward (gathered fp32 params + max of log-prob and target pass)"],
        "optimizer step": state + t["_optimizer_step_temp"],
        # mopd.signal.passes=shared: the token pass's backward with every term's saved tensors alive (one forward)
        # and each term's gradient in its own fp32 shard (tok, SATS, VR, hidden: 3 beyond the grads row). An upper
        # estimate: the layer inputs both passes keep are counted twice; not measured (--check covers the others)
        "shared pass (passes=shared)": state + 3 * t["grads (fp32 shard)"] + t["_token_pass_backward"]
        + t["activations, alignment pass (SATS)"] + t["_vr_rows"],
    }


def print_table(run: Run) -> None:
    shapes = (QWEN3_1_7B, QWEN3_8B)
    tabs = {s.name: table(s, run) for s in shapes}
    print(f"MOPD peak memory per rank, GiB: {run.ranks} ranks, {run.responses_per_rank} responses per rank, "
          f"{run.seq:,}-token sequences, token micro-batch {run.mb_tokens:,} tokens, alignment micro-batch "
          f"{run.align_rows} x {run.seq:,}, W = {run.window}, {run.regions} regions, {run.grad_copies} extra "
          "balancing copies")
    print(f"{'component':76s}" + "".join(f"{s.name:>12s}" for s in shapes))
    for k in tabs[shapes[0].name]:
        if not k.startswith("_"):
            print(f"{k:76s}" + "".join(f"{tabs[s.name][k] / GiB:12.1f}" for s in shapes))
    for phase in ("token pass", "alignment pass", "teacher forward", "optimizer step", "shared pass (passes=shared)"):
        print(f"{'peak, ' + phase + ' (device)':76s}" + "".join(f"{peaks(tabs[s.name])[phase] / GiB:12.1f}"
                                                                 for s in shapes))
    for s in shapes:
        t = tabs[s.name]
        print(f"{s.name}: {s.params / 1e9:.2f}B params; teacher targets {t['_per_response_targets'] / GiB:.2f} GiB "
              f"per response, {t['_unbounded_targets'] / GiB:.1f} GiB per rank unbounded")


# ----------------------------------------------------------------------------------------------------------------
# Every row measured at a reduced size (CPU, exact tensor bytes)

REDUCED = (Shape("reduced", 3, 384, 6, 2, 64, 1024, 16_384, False),
           Run(ranks=1, responses_per_rank=2, seq=1536, mb_tokens=2048, window=384, regions=8, chunk=256,
               pinned_pow2=False))
TINY = (Shape("tiny", 2, 128, 4, 2, 32, 384, 4096, False),
        Run(ranks=1, responses_per_rank=2, seq=512, mb_tokens=768, window=128, regions=4, chunk=64,
            pinned_pow2=False))


def _model(s: Shape, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                      vocab_size=s.vocab, tie_word_embeddings=s.tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    model.config.use_cache = False
    return model


def _region_batch(s: Shape, r: Run):
    """``align_rows`` full-length rows whose window holds exactly ``regions`` reasoning steps."""
    import torch

    from claas_verl.align import step_regions

    T, prompt = r.seq, r.seq // 8
    ids = torch.randint(10, min(s.vocab, 1000), (r.align_rows, T), generator=torch.Generator().manual_seed(0))
    step = r.window // r.regions
    ids[:, T - r.window + step - 1::step] = 7
    am = torch.ones_like(ids)
    reg = step_regions(ids[:, prompt:], am[:, prompt:], {7}, window=r.window).pad_left(prompt)
    if int(reg.num_regions.max()) != r.regions:
        raise RuntimeError(f"{int(reg.num_regions.max())} regions, wanted {r.regions}")
    return ids, am, reg


def measure(s: Shape, r: Run) -> dict[str, float]:
    """Each row of :func:`table` (except the host target budget) measured in bytes at shape ``s``, one rank."""
    import torch

    from claas_verl.align import alignment_losses, alignment_signals
    from claas_verl.align.balance import HostBalancer
    from claas_verl.align.target_store import signals_bytes
    from claas_verl.distill import teacher_logprobs_at, topk_distill_loss
    from claas_verl.utils.live_bytes import LiveBytes

    got: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    # state: the fp32 master model, its gradients, AdamW, the bf16 copies FSDP2 gathers, the host buffers
    model = _model(s, torch.float32)
    layers = model.model.layers
    gathered = [p for m in (model.model.embed_tokens, model.model.norm, model.lm_head, layers[0], layers[1])
                for p in m.parameters(recurse=True)]
    with LiveBytes() as mem:
        copies = [p.detach().to(torch.bfloat16) for p in {id(p): p for p in gathered}.values()]
    got["params (fp32 shard + bf16 gathered root and 2 layers)"] = sum(p.nbytes for p in model.parameters()) + mem.now
    del copies
    ids = torch.randint(0, s.vocab, (1, 16), generator=g)
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    got["grads (fp32 shard)"] = sum(p.grad.nbytes for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    opt.step()
    got["optimizer (AdamW, fp32 shard)"] = sum(v.nbytes for st in opt.state.values() for v in st.values()
                                               if torch.is_tensor(v) and v.dim() > 0)
    params = list(model.parameters())
    hb = HostBalancer(params, buffers={})
    for term in ("tok", "sats", "vr"):
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()  # the pass's gradient in .grad
        hb.take_token() if term == "tok" else hb.take_pooled(term)
    got["balancing buffers g_tok and u, host RAM (pinned)"] = sum(v.nbytes for v in hb.buffers.values())
    del model, opt, hb, params, gathered

    # passes: bf16 model with gradient checkpointing (verl: use_reentrant=False); parameters frozen so that the
    # live bytes are activations only (their gradients are the grads row); the embedding output needs the grad
    model = _model(s, torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(False)
    model.model.embed_tokens.register_forward_hook(lambda mod, args, out: out.detach().requires_grad_(True))
    N = r.mb_tokens
    ids = torch.randint(0, s.vocab, (1, N), generator=g)
    with LiveBytes() as mem:
        h = model.model(input_ids=ids).last_hidden_state
        h.backward(torch.ones_like(h))
        del h
    got["activations, token pass"] = mem.peak

    k = 16
    cand = torch.randint(0, s.vocab, (1, N, k), generator=g)
    adv, mask = torch.randn(1, N, k, generator=g), torch.ones(1, N)
    with LiveBytes() as mem:
        logits = torch.empty(1, N, s.vocab, dtype=torch.bfloat16).normal_(generator=g).requires_grad_(True)
        topk_distill_loss(logits, cand, adv, mask, chunk_size=r.chunk).backward()
        del logits
    got["logits chunks, token pass"] = mem.peak

    ids, am, reg = _region_batch(s, r)
    layer_ids = range(s.layers)
    with torch.no_grad():
        _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=layer_ids, logits=False)
        targets = sig.as_targets()
        del sig
    with LiveBytes() as mem:
        device_targets = type(targets)(sats={i: type(v)(v.rows.clone(), v.key_start)
                                             for i, v in targets.sats.items()})
        _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=layer_ids, logits=False)
        alignment_losses(sig, device_targets, reg)["sats"].loss.backward()
        del sig, device_targets
    got["activations, alignment pass (SATS)"] = mem.peak

    # teacher: fp32 weights gathered (root + 2 layers), bf16 compute; log-prob pass and all-terms target pass
    teacher = _model(s, torch.bfloat16).eval()
    with LiveBytes() as mem, torch.no_grad():
        out, tsig = alignment_signals(teacher, ids, am, reg, pooled_layers=layer_ids, hidden_layers=layer_ids,
                                      logits=False)
        held = tsig.as_targets()
        del out, tsig
    target_pass = mem.peak
    per_response = signals_bytes(held) / r.align_rows
    del held
    tok = torch.randint(0, s.vocab, (1, N), generator=g)
    with LiveBytes() as mem, torch.no_grad():
        logits = teacher(input_ids=tok).logits
        teacher_logprobs_at(logits, cand, chunk_size=r.chunk)
        del logits
    got["_token_pass_logprob"] = mem.peak
    got["_target_pass"] = target_pass
    got["_per_response_targets"] = per_response
    return got


def check(s: Shape, r: Run) -> list[tuple[str, float, float]]:
    """``(row, predicted, measured)`` for every measured row; raises if one is off by more than 15%."""
    want, got = table(s, r), measure(s, r)
    teacher_row = "teacher forward (gathered fp32 params + max of log-prob and target pass)"
    # the teacher's gathered fp32 params are a count of parameters, not an allocation of this process
    want[teacher_row] -= want["_teacher_params"]
    got[teacher_row] = max(got["_token_pass_logprob"], got["_target_pass"])
    # the device transit copy of the balancing row exists on a GPU only (make gpu-check)
    want.pop("balancing on the device (fp32 shards + one in transit)")
    want["teacher targets, host RAM (bounded)"] = want["_per_response_targets"]
    got["teacher targets, host RAM (bounded)"] = got["_per_response_targets"]
    rows = [(k, want[k], got[k]) for k in want if not k.startswith("_")]
    rows += [(k, want[k], got[k]) for k in ("_token_pass_logprob", "_target_pass")]
    bad = [(k, p, m) for k, p, m in rows if not abs(m / p - 1) <= TOLERANCE]
    for k, p, m in rows:
        print(f"check {s.name}: {k:76s} predicted {p / 2**20:9.2f} MiB, measured {m / 2**20:9.2f} MiB "
              f"({m / p:.3f}x)")
    if bad:
        raise SystemExit(f"{len(bad)} rows off by more than {TOLERANCE:.0%}: {[k for k, _, _ in bad]}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="measure every row at a reduced size on CPU")
    ap.add_argument("--tiny", action="store_true", help="with --check: the test-suite size (seconds)")
    ap.add_argument("--grad-copies", type=int, default=Run.grad_copies)
    ap.add_argument("--align-rows", type=int, default=Run.align_rows)
    ap.add_argument("--regions", type=int, default=Run.regions)
    ap.add_argument("--target-budget-gib", type=float, default=Run.target_budget_gib)
    args = ap.parse_args(argv)
    if args.check:
        import torch

        torch.set_num_threads(1)
        check(*(TINY if args.tiny else REDUCED))
        if args.tiny:
            return
    print_table(Run(grad_copies=args.grad_copies, align_rows=args.align_rows, regions=args.regions,
                    target_budget_gib=args.target_budget_gib))


if __name__ == "__main__":
    main(sys.argv[1:])
