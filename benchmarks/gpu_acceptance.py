"""The GPU path's acceptance check: the riskiest MOPD/CLaaS code paths on one GPU, offline, one JSON report.

    make gpu-check                                   # = python benchmarks/gpu_acceptance.py --out gpu_report.json
    python benchmarks/gpu_acceptance.py --cpu        # the same code paths at tiny shapes on CPU (the test suite's)

Random-weight models at realistic widths (Qwen3-8B and DeepSeek-R1-Distill-Qwen-1.5B, a few layers, vocabulary
151,936) and the tiny byte-level tokenizer of :mod:`claas_verl.tiny`; nothing is downloaded. Checks:

* ``teacher_targets_<family>``: ``MOPDWorker._teacher_targets`` (the worker's own code) at ~18k tokens with a
  forward-only FSDP2 teacher whose fp32 weights rest on the host (CPU offload) under bf16 autocast: every term's
  targets finite and of the predicted size (:func:`claas_verl.align.target_bytes`);
* ``balanced_replay_step``: ``MOPDTrainingWorker.balanced_engine_step`` on an FSDP2 (one rank) Qwen3-8B-width
  student with gradient checkpointing, ``mopd.signal.passes: separate``: the top-k token pass, the SATS/VR/hidden
  passes, the host-side
  balancing and the first AdamW step, with the peak memory of the token pass and of the whole step
  (``torch.cuda.max_memory_allocated``; on CPU the exact live bytes of :class:`claas_verl.utils.live_bytes.LiveBytes`)
  against ``benchmarks/mopd_memory_table.py``'s phases; ``balanced_replay_step_tied``: the same on a
  tied-embedding Qwen3-1.7B-width student (a second shape for the same formulas);
* ``topk_loss``: the chunked top-k distillation loss at 24,576 tokens x V, its gradient against the unchunked loss
  on the first rows, and its peak against the table's logits row;
* ``host_balancer``: :class:`claas_verl.align.balance.HostBalancer` at the 8B student's shard shapes (4 ranks)
  against the device reference (``combine_aux`` then ``balance``), its pinned host bytes, and its device peak
  (one pass's gradient + one shard in transit) against the table;
* ``replay_step_ratios``: exact and carried replay steps / token-only, host syncs per step (benchmarks/replay_floor.py);
* ``vllm_reload_and_lora``: an in-process vLLM engine: prompt log-probs equal to an HF forward, after a
  full-weight reload, and with a LoRA adapter (skipped, with the reason, when vLLM is not importable).

Flash attention is used where ``flash_attn`` is importable (recorded in the report). Each check records ``name``,
``ok``, ``numbers``, ``seconds`` and ``skipped`` (a reason) or ``error``; the exit status is 1 when one failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_stand_ins import Engine, Meter, _device  # noqa: E402,F401 (replay_floor reads them from here)
from benchmarks.mopd_memory_table import QWEN3_1_7B, QWEN3_8B, Run, Shape, table, token_pass_backward  # noqa: E402,E501

MEMORY_TOLERANCE = 0.15
SEP = 7  # the reasoning-step separator token of the synthetic responses


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Shapes and lengths of one mode (GPU: realistic; CPU: tiny, same code paths)."""

    qwen3: Shape
    qwen3_tied: Shape  # a second, tied-embedding student for the balanced step (Qwen3-1.7B width)
    r1: Shape  # Qwen2 architecture (DeepSeek-R1-Distill-Qwen-1.5B)
    prompt: int
    response: int
    window: int
    regions: int
    topk_tokens: int
    balancer_ranks: int
    balancer_shape: Shape


GPU = Sizes(
    qwen3=dataclasses.replace(QWEN3_8B, name="Qwen3-8B width, 2 layers", layers=2),
    qwen3_tied=dataclasses.replace(QWEN3_1_7B, name="Qwen3-1.7B width, 4 layers", layers=4),
    r1=Shape("R1-Distill-Qwen-1.5B width, 2 layers", 2, 1536, 12, 2, 128, 8960, 151_936, False),
    prompt=2048, response=16_384, window=2000, regions=21, topk_tokens=24_576, balancer_ranks=4,
    balancer_shape=QWEN3_8B,
)
CPU = Sizes(
    qwen3=Shape("Qwen3 tiny", 2, 64, 2, 1, 32, 128, 2048, False),
    qwen3_tied=Shape("Qwen3 tiny, tied", 3, 64, 2, 1, 32, 128, 2048, True),
    r1=Shape("Qwen2 tiny", 2, 64, 2, 1, 32, 128, 2048, False),
    prompt=32, response=160, window=64, regions=4, topk_tokens=768, balancer_ranks=4,
    balancer_shape=Shape("Qwen3 tiny", 2, 64, 2, 1, 32, 128, 2048, False),
)


# ----------------------------------------------------------------------------------------------------------------
# helpers


def attn_implementation() -> str:
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def build_model(shape: Shape, family: str, dtype, seed: int = 0):
    """A random-weight HF causal LM of ``shape`` (Qwen3, or Qwen2 for the R1-Distill family)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(hidden_size=shape.hidden, intermediate_size=shape.mlp, num_hidden_layers=shape.layers,
                     num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                     vocab_size=shape.vocab, tie_word_embeddings=shape.tied, max_position_embeddings=32_768,
                     attn_implementation=attn_implementation(), initializer_range=0.05)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype)
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def process_group():
    """A one-rank process group (NCCL on a GPU, gloo on CPU) for FSDP2, torn down afterwards."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def shard(model, *, offload: bool, bf16_compute: bool):
    """FSDP2 over every decoder layer and the root, as verl's engine applies it."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if bf16_compute:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def replay_batch(sizes: Sizes, cfg, rows: int = 1, seed: int = 0):
    """verl's no-padding batch layout of ``rows`` full-length responses with ``regions`` steps in the window."""
    import torch
    from verl.utils import tensordict_utils as tu

    from claas_verl.mopd.trainer import alignment

    g = torch.Generator().manual_seed(seed)
    step = sizes.window // sizes.regions
    seqs, responses = [], []
    for _ in range(rows):
        response = torch.randint(10, 1000, (sizes.response,), generator=g)
        response[response == SEP] = SEP + 1
        response[sizes.response - sizes.window + step - 1::step] = SEP
        responses.append(response)
        seqs.append(torch.cat([torch.randint(10, 1000, (sizes.prompt,), generator=g), response]))
    padded = torch.stack(responses)
    mask = torch.ones_like(padded)
    rid, win = alignment.response_regions(padded, mask, {SEP}, cfg)
    nest = lambda xs: torch.nested.nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    data = tu.get_tensordict({
        "input_ids": nest(seqs),
        "response_mask": nest([torch.ones(sizes.response, dtype=torch.long) for _ in range(rows)]),
        alignment.REGION_IDS: nest([rid[i] for i in range(rows)]),
        alignment.WINDOW: nest([win[i] for i in range(rows)]),
    })
    tu.assign_non_tensor_data(data, alignment.AUX_KEY, cfg.to_dict())
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    return data


# ----------------------------------------------------------------------------------------------------------------
# checks


def check_teacher_targets(sizes: Sizes, family: str) -> dict:
    import torch

    from claas_verl.align import target_bytes
    from claas_verl.align.target_store import signals_bytes
    from claas_verl.mopd.trainer import alignment
    from claas_verl.mopd.trainer.balanced_passes import micro_batches, update_row_groups
    from claas_verl.mopd.trainer.workers import MOPDWorker

    shape = sizes.qwen3 if family == "qwen3" else sizes.r1
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "window": sizes.window})
    data = replay_batch(sizes, cfg)
    numbers = {"tokens": sizes.prompt + sizes.response, "attn": attn_implementation()}
    with process_group():
        teacher = build_model(shape, family, torch.float32).eval()  # fp32 weights, bf16 autocast (teacher_dtype)
        teacher.requires_grad_(False)
        if torch.cuda.is_available():
            shard(teacher, offload=True, bf16_compute=False)  # weights rest on the host, layers gathered to the GPU
        worker = type("TeacherWorker", (), {"engine": Engine(teacher, autocast_dtype=torch.bfloat16)})()
        groups = update_row_groups(data)
        meter = Meter()
        t0 = time.perf_counter()
        with meter.measure():
            held = MOPDWorker._teacher_targets(None, worker, data, cfg, groups)
        numbers["forward_seconds"] = time.perf_counter() - t0
        numbers["peak_gib"] = meter.peak / 2**30
    sig = held["targets"][0]
    mb = micro_batches(data, groups)[0]
    want = target_bytes(mb.regions, mb.attention_mask, cfg.terms, pooled_layers=shape.layers,
                        hidden_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                        hidden_size=shape.hidden)
    got = signals_bytes(sig)
    tensors = [v.rows for v in (*sig.sats.values(), *sig.vr.values())] + list(sig.hidden.values())
    numbers.update(target_bytes=got, predicted_bytes=want,
                   finite=all(bool(torch.isfinite(t.float()).all()) for t in tensors),
                   on_host=all(t.device.type == "cpu" for t in tensors),
                   dtype_bf16=all(t.dtype == torch.bfloat16 for t in tensors))
    numbers["ok"] = got == want and numbers["finite"] and numbers["on_host"] and numbers["dtype_bf16"]
    return numbers


def step_memory_phases(shape: Shape, sizes: Sizes) -> dict[str, float]:
    """Predicted device bytes of ``check_balanced_step``'s phases above the student's fp32 parameters.

    One micro-batch on one rank and the first optimizer step, so the gradient and AdamW shards appear inside the
    step (:func:`benchmarks.mopd_memory_table.token_pass_backward` with ``first_micro_batch``). On CPU the
    balancing buffers are live bytes too; on a GPU they are pinned host memory, which CUDA's counters do not see.
    """
    T = sizes.prompt + sizes.response
    run = Run(ranks=1, seq=T, mb_tokens=T, window=sizes.window, regions=sizes.regions, chunk=min(1024, T),
              pinned_pow2=False)
    want = table(shape, run)
    gathered = 2 * shape.root_params + 2 * 2 * shape.layer_params  # FSDP2's bf16 root and two layers
    return {
        "token pass": gathered + token_pass_backward(shape, run, first_micro_batch=True),
        "alignment pass": gathered + want["grads (fp32 shard)"] + want["activations, alignment pass (SATS)"]
        + want["balancing on the device (fp32 shards + one in transit)"],
        "optimizer step": want["grads (fp32 shard)"] + want["optimizer (AdamW, fp32 shard)"]
        + want["_optimizer_step_temp"],
        "host balancing buffers": want["balancing buffers g_tok and u, host RAM (pinned)"],
    }


def check_balanced_step(sizes: Sizes, student: str = "qwen3") -> dict:
    import torch

    from claas_verl.mopd.trainer import alignment
    from claas_verl.mopd.trainer.workers import MOPDTrainingWorker, MOPDWorker, update_row_groups

    shape = getattr(sizes, student)
    # the separate passes: the schedule whose memory the table's phases model (passes=shared's peak is a formula)
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 1.0, "window": sizes.window,
                                "passes": "separate"})
    data = replay_batch(sizes, cfg, seed=1)
    device = _device()
    T = sizes.prompt + sizes.response
    numbers: dict = {"tokens": T, "attn": attn_implementation(), "shape": shape.name}
    with process_group():
        teacher = build_model(shape, "qwen3", torch.bfloat16, seed=1).to(device).eval().requires_grad_(False)
        held = MOPDWorker._teacher_targets(None, type("T", (), {"engine": Engine(teacher)})(), data, cfg,
                                           update_row_groups(data))
        del teacher
        student = build_model(shape, "qwen3", torch.float32).to(device).train()
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        shard(student, offload=False, bf16_compute=True)
        engine = Engine(student, autocast_dtype=torch.bfloat16)
        worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
        worker.engine, worker.mopd_targets = engine, held
        meter = Meter()
        with meter.measure():
            out = worker.balanced_engine_step(data, None, cfg)
        metrics = {k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/")}
    phases = step_memory_phases(shape, sizes)
    host_buffers = phases.pop("host balancing buffers")
    host = 0 if torch.cuda.is_available() else host_buffers
    predicted = {"token pass": phases["token pass"], "step": max(phases.values()) + host}
    numbers["step_phases_predicted_gib"] = {k: v / 2**30 for k, v in phases.items()}
    measured = {"token pass": engine.phase_peaks["token pass"], "step": meter.peak}
    numbers.update({f"{k}_measured_gib": v / 2**30 for k, v in measured.items()})
    numbers.update({f"{k}_predicted_gib": v / 2**30 for k, v in predicted.items()})
    numbers["memory_ratio"] = {k: measured[k] / predicted[k] for k in measured}
    numbers["metrics"] = metrics
    numbers["grad_norm"] = engine.grad_norm
    losses_ok = all(math.isfinite(metrics[f"mopd/{t}_loss"]) and metrics[f"mopd/{t}_loss"] > 0
                    for t in ("sats", "vr", "hidden"))
    # on a GPU the phase peaks must agree with the table (at the CPU mode's tiny shapes the rows are checked by
    # the table's own --check; here they are recorded)
    memory_ok = not torch.cuda.is_available() or all(abs(v - 1) <= MEMORY_TOLERANCE
                                                     for v in numbers["memory_ratio"].values())
    numbers["ok"] = losses_ok and math.isfinite(engine.grad_norm or float("nan")) and memory_ok
    return numbers


def check_topk_loss(sizes: Sizes) -> dict:
    import torch

    from claas_verl.distill import topk_distill_loss

    device, N, V, K = _device(), sizes.topk_tokens, sizes.qwen3.vocab, 16
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, V, (1, N, K), generator=g, device=device)
    adv, mask = torch.randn(1, N, K, generator=g, device=device), torch.ones(1, N, device=device)
    chunk = min(1024, N // 4)
    meter = Meter()
    with meter.measure():  # the table's row: the bf16 logits, their gradient and the chunks' fp32 temporaries
        logits = torch.empty(1, N, V, device=device, dtype=torch.bfloat16).normal_(generator=g).requires_grad_(True)
        loss = topk_distill_loss(logits, ids, adv, mask, chunk_size=chunk)
        loss.backward()
    n = 2 * chunk  # the unchunked reference on the first two chunks' rows (token mean: weight n / N)
    grad = logits.grad[:, :n].float()
    ref_logits = logits.detach()[:, :n].clone().requires_grad_(True)
    (topk_distill_loss(ref_logits, ids[:, :n], adv[:, :n], mask[:, :n], chunk_size=None) * (n / N)).backward()
    err = float((grad - ref_logits.grad.float()).abs().max() / ref_logits.grad.float().abs().max())
    run = Run(ranks=1, mb_tokens=N, chunk=chunk)
    predicted = table(dataclasses.replace(sizes.qwen3, vocab=V), run)["logits chunks, token pass"]
    ratio = meter.peak / predicted
    return {"tokens": N, "vocab": V, "loss": float(loss.detach()), "grad_rel_err_vs_unchunked": err,
            "peak_gib": meter.peak / 2**30, "predicted_gib": predicted / 2**30, "memory_ratio": ratio,
            "ok": math.isfinite(float(loss.detach())) and err < 2e-2 and abs(ratio - 1) <= MEMORY_TOLERANCE}


def check_host_balancer(sizes: Sizes) -> dict:
    import torch

    from benchmarks.mopd_memory_table import _shard
    from claas_verl.align.balance import HostBalancer, balance, combine_aux

    device = _device()
    shapes = [(_shard(s, sizes.balancer_ranks),) for s in sizes.balancer_shape.param_shapes()]
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    g = torch.Generator(device=device).manual_seed(0)

    def grads(scale):
        return [torch.randn(p.shape, generator=g, device=device) * scale for p in params]

    terms = {"tok": grads(1.0), "sats": grads(0.3), "vr": grads(0.2), "hid": grads(2.0)}
    t0 = time.perf_counter()
    ref_aux, _ = combine_aux(terms["sats"], terms["vr"], terms["hid"], 2.0, sync=False)
    ref, ref_info = balance(terms["tok"], ref_aux, 1.0, sync=False)
    ref_seconds = time.perf_counter() - t0
    del ref_aux
    buffers: dict = {}
    meter = Meter()
    t0 = time.perf_counter()
    with meter.measure():
        hb = HostBalancer(params, variant="fsar", ratio=1.0, rho=2.0, sync=False, buffers=buffers)
        for name in ("tok", "sats", "vr", "hid"):
            for p, x in zip(params, terms[name]):
                p.grad = x.clone()
            if name == "tok":
                hb.take_token()
            elif name != "hid":
                hb.take_pooled(name)
        info = hb.finish("hidden")
    host_seconds = time.perf_counter() - t0
    num = sum(float((p.grad - r).double().pow(2).sum()) for p, r in zip(params, ref))
    den = sum(float(r.double().pow(2).sum()) for r in ref)
    host_bytes = sum(b.nbytes for b in buffers.values())
    pinned = all(b.is_pinned() for b in buffers.values()) if torch.cuda.is_available() else None
    transit = 4 * max(p.numel() for p in params)
    # on the device: the gradient of the pass in flight (the table's grads row; the loop above writes it) and one
    # parameter's shard in transit to or from the host (its balancing row); on CPU the host buffers count too
    device_predicted = 4 * sum(p.numel() for p in params) + transit
    ratio = meter.peak / device_predicted
    memory_ok = not torch.cuda.is_available() or abs(ratio - 1) <= MEMORY_TOLERANCE
    return {"params_per_rank": sum(p.numel() for p in params), "rel_err": math.sqrt(num / den),
            "final_norm": info["final_norm"], "ref_final_norm": ref_info["final_norm"],
            "host_gib": host_bytes / 2**30, "pinned": pinned, "device_peak_gib": meter.peak / 2**30,
            "device_transit_predicted_gib": transit / 2**30, "device_predicted_gib": device_predicted / 2**30,
            "memory_ratio": ratio, "host_seconds": host_seconds, "device_reference_seconds": ref_seconds,
            "ok": math.sqrt(num / den) < 1e-5 and (pinned is not False) and memory_ok}


def check_vllm(sizes: Sizes, work: Path) -> dict:
    """In-process vLLM: prompt log-probs vs HF, after a full-weight reload, and with a LoRA adapter."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not importable in this environment (GPU install: see docs/getting-started.md)"}
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "the vLLM check runs on a GPU (the CPU build is covered by make test-vllm)"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: reload in place
    from peft import LoraConfig, get_peft_model
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from claas_verl.tiny.tokenizer import train_tokenizer

    shape = dataclasses.replace(sizes.qwen3, hidden=1024, heads=16, kv_heads=8, mlp=3072, name="Qwen3 (vLLM)")
    model_dir, lora_dir = work / "vllm_model", work / "vllm_lora"
    tok = train_tokenizer([f"step {i}: the answer is {i * 7 % 13}." for i in range(400)], vocab_size=512)
    hf = build_model(shape, "qwen3", torch.bfloat16).eval()
    hf.config.attn_implementation = "sdpa"
    hf.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompt = torch.randint(10, 500, (64,), generator=torch.Generator().manual_seed(0)).tolist()

    def hf_logprobs(model):
        with torch.no_grad():
            logits = model.to("cuda")(input_ids=torch.tensor([prompt], device="cuda")).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(prompt[1:], device="cuda")[:, None])
        return lp[:, 0].cpu()

    llm = LLM(model=str(model_dir), dtype="bfloat16", enable_lora=True, max_lora_rank=8, max_loras=1,
              gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True, enable_prefix_caching=False)

    def vllm_logprobs(lora=None):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora, use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    numbers = {}
    numbers["base_max_abs_diff"] = float((vllm_logprobs() - hf_logprobs(hf)).abs().max())
    # full-weight reload, as verl's rollout syncs the actor's weights: new weights into the running engine
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.05)
    llm.collective_rpc(lambda self, weights: self.model_runner.model.load_weights(weights),
                       args=([(k, v.cuda()) for k, v in hf.state_dict().items()],))
    numbers["reload_max_abs_diff"] = float((vllm_logprobs() - hf_logprobs(hf)).abs().max())
    lora = get_peft_model(hf.cpu().float(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    lora.save_pretrained(lora_dir)
    numbers["lora_max_abs_diff"] = float((vllm_logprobs(LoRARequest("a", 1, str(lora_dir)))
                                          - hf_logprobs(lora.to(torch.bfloat16))).abs().max())
    numbers["ok"] = max(numbers.values()) < 0.1
    return numbers


# ----------------------------------------------------------------------------------------------------------------


def run_check(name: str, fn, *args) -> dict:
    t0 = time.perf_counter()
    record = {"name": name, "ok": False, "numbers": {}, "seconds": 0.0, "skipped": None}
    try:
        numbers = fn(*args)
        if "skipped" in numbers:
            record.update(ok=True, skipped=numbers.pop("skipped"))
        else:
            record["ok"] = bool(numbers.pop("ok"))
        record["numbers"] = numbers
    except Exception as exc:  # a failed check is recorded; the others still run
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=8)
    finally:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record["seconds"] = time.perf_counter() - t0
    print(json.dumps({k: record[k] for k in ("name", "ok", "seconds", "skipped")} | {"error": record.get("error")}),
          flush=True)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (same code paths; the test suite's)")
    ap.add_argument("--out", default="gpu_report.json", help="the JSON report")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks (names)")
    args = ap.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --cpu for the tiny CPU mode")
    if args.cpu:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    sizes = CPU if args.cpu else GPU
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan = [
            ("teacher_targets_qwen3", check_teacher_targets, sizes, "qwen3"),
            ("teacher_targets_r1_distill", check_teacher_targets, sizes, "qwen2"),
            ("balanced_replay_step", check_balanced_step, sizes),
            ("balanced_replay_step_tied", check_balanced_step, sizes, "qwen3_tied"),
            ("topk_loss", check_topk_loss, sizes),
            ("host_balancer", check_host_balancer, sizes),
            ("vllm_reload_and_lora", check_vllm, sizes, Path(tmp)),
            ("replay_step_ratios", importlib.import_module("benchmarks.replay_floor").check_replay_ratios, sizes),
        ]
        checks = [run_check(name, fn, *a) for name, fn, *a in plan if not args.only or name in args.only]
    report = {
        "mode": "cpu" if args.cpu else "gpu",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "attn_implementation": attn_implementation(),
        "vllm": importlib.util.find_spec("vllm") is not None,
        "seconds": time.perf_counter() - t0,
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
    }
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"{'OK' if report['ok'] else 'FAILED'}: {sum(c['ok'] for c in checks)}/{len(checks)} checks in "
          f"{report['seconds']:.0f} s; report {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
