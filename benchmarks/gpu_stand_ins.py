"""Stand-ins of the GPU acceptance check (``benchmarks/gpu_acceptance.py``): the device, a peak-memory meter and the
surface of verl's FSDP engine that the MOPD worker's balanced step and target forward use."""

from __future__ import annotations

import contextlib
import math


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Meter:
    """Peak bytes allocated inside a block above what was allocated at its start (CUDA stats, or LiveBytes)."""

    def __init__(self):
        self.peak = 0

    @contextlib.contextmanager
    def measure(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            yield self
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - start
        else:
            from claas_verl.utils.live_bytes import LiveBytes

            with LiveBytes() as mem:
                yield self
            self.peak = mem.peak


class Engine:
    """The surface of verl's FSDP engine that the MOPD worker's balanced step and target forward use.

    Its token pass is the top-k distillation loss of every micro-batch verl would run (``update_row_groups``),
    weighted ``n_resp(mb)/n_resp`` (B.7), so its memory is the table's token pass (activations + logits chunks).
    """

    def __init__(self, module, autocast_dtype=None, topk: int = 16):
        import torch

        self.module, self.scaler, self.topk = module, None, topk
        self._autocast_dtype = autocast_dtype
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-6) if trainable else None
        self.phase_peaks: dict[str, int] = {}
        self.grad_norm = None

    def eval_mode(self):
        return contextlib.nullcontext()

    def is_mp_src_rank_with_outputs(self):
        return True

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        import torch

        from claas_verl.distill import topk_distill_loss
        from claas_verl.mopd.trainer.balanced_passes import micro_batches, update_row_groups
        from claas_verl.verl_ext.engine_device import engine_autocast

        device = _device()
        micro = micro_batches(data, update_row_groups(data))
        n = sum(mb.n_resp for mb in micro)
        meter = Meter()
        with meter.measure():
            for mb in micro:
                mb = mb.to(device)
                g = torch.Generator(device=device).manual_seed(0)
                T = mb.input_ids.shape[1]
                with engine_autocast(self, device):
                    logits = self.module(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                         position_ids=mb.position_ids, use_cache=False).logits
                ids = torch.randint(0, logits.shape[-1], (1, T, self.topk), generator=g, device=device)
                adv = torch.randn(1, T, self.topk, generator=g, device=device)
                loss = topk_distill_loss(logits, ids, adv, mb.attention_mask.float()) * (mb.n_resp / n)
                loss.backward()
                del logits, loss
        self.phase_peaks["token pass"] = meter.peak
        return {"loss": [0.0], "metrics": {}, "model_output": {}}

    def shared_token_loss(self, logits, data, rows):
        """The same stand-in loss on the shared forward's response logits (``mopd.signal.passes: shared``)."""
        import torch

        from claas_verl.distill import topk_distill_loss

        g, (b, R, V) = torch.Generator(device=logits.device).manual_seed(0), logits.shape
        ids = torch.randint(0, V, (b, R, self.topk), generator=g, device=logits.device)
        adv = torch.randn(b, R, self.topk, generator=g, device=logits.device)
        return topk_distill_loss(logits, ids, adv, torch.ones(b, R, device=logits.device)), {}

    def optimizer_step(self):
        import torch

        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        self.grad_norm = math.sqrt(sum(float(x.float().pow(2).sum()) for x in local))
        finite = all(bool(torch.isfinite(x).all()) for x in local)
        self.optimizer.step()
        return self.grad_norm if finite else float("nan")
