"""The disk a continual MOPD run's checkpoints take, from the recipe's checkpoint keys and the student's size.

verl writes a checkpoint every ``trainer.save_freq`` steps (and the MOPD trainer at every stage end), each with the
parts ``actor_rollout_ref.actor.checkpoint.save_contents`` names, and keeps ``trainer.max_actor_ckpt_to_keep`` of
them (all when unset). Per parameter (``recipes/mopd/verl/*.yaml``: fp32 master weights, AdamW):

* ``model``: the sharded weights in ``actor.fsdp_config.model_dtype`` (fp32: 4 bytes);
* ``optimizer``: AdamW's two moments in the same dtype (8 bytes);
* ``hf_model``: the Hugging Face export verl writes in bf16 (2 bytes);

so 14 bytes per parameter and checkpoint. The trainer also copies each stage's export to ``snapshots/student_<j>``
(M_j, 2 bytes per parameter, kept to the end: later stages use them as teachers). the MOPD paper's FSAR recipe (174
steps, a checkpoint every 5 and at the 5 stage ends) writes 37 checkpoints: with verl's own default (keep all) about
0.94 TB for its 1.78B student and 4.3 TB at 8.2B; keeping 2 (``recipes/mopd/verl/common.yaml``), 68 GB and 311 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
HF_EXPORT_BYTES = 2  # verl's hf_model export and the stage snapshots: bf16


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


@dataclass(frozen=True)
class CheckpointDisk:
    params: int
    per_checkpoint: int  # bytes of one checkpoint
    saves: int  # checkpoints the run writes
    kept: int | None  # trainer.max_actor_ckpt_to_keep (None: all)
    on_disk: int  # the most checkpoints on disk at once
    snapshots: int  # stage snapshots M_j
    snapshot_bytes: int

    @property
    def total(self) -> int:
        """Peak bytes under ``trainer.default_local_dir``."""
        return self.on_disk * self.per_checkpoint + self.snapshots * self.snapshot_bytes

    def summary(self) -> str:
        keep = "all (verl's default)" if self.kept is None else str(self.kept)
        return (f"checkpoint disk: {human(self.total)} at most under trainer.default_local_dir "
                f"({count(self.params)} parameters: {self.on_disk} of {self.saves} checkpoints x "
                f"{human(self.per_checkpoint)}, keeping {keep} [trainer.max_actor_ckpt_to_keep], + "
                f"{self.snapshots} stage snapshots x {human(self.snapshot_bytes)})")


def checkpoint_steps(stage_of_step: list[int], save_freq: int) -> list[int]:
    """verl's global steps (1-based) that write a checkpoint: every ``save_freq``-th, the last, and stage ends."""
    n = len(stage_of_step)
    ends = {i + 1 for i in range(n) if i == n - 1 or stage_of_step[i + 1] != stage_of_step[i]}
    periodic = {g for g in range(1, n + 1) if save_freq > 0 and g % save_freq == 0}
    return sorted(ends | periodic)


def bytes_per_parameter(save_contents, model_dtype: str) -> int:
    weight = DTYPE_BYTES[str(model_dtype)]
    parts = {"model": weight, "optimizer": 2 * weight, "hf_model": HF_EXPORT_BYTES}
    return sum(parts.get(str(c), 0) for c in save_contents)


def checkpoint_disk(cfg: DictConfig, plan, params: int, steps: int | None = None) -> CheckpointDisk:
    """The checkpoint disk of ``plan`` (its first ``steps`` steps) for a student of ``params`` parameters."""
    trainer, actor = cfg.trainer, cfg.actor_rollout_ref.actor
    stages = [s.stage for s in plan.steps][: steps or None]
    saves = len(checkpoint_steps(stages, int(trainer.get("save_freq", -1) or -1)))
    kept = trainer.get("max_actor_ckpt_to_keep")
    kept = int(kept) if kept is not None and int(kept) > 0 else None
    # verl trims to keep-1 before a save, except with keep=1, where the old one stays until the new one is written
    on_disk = saves if kept is None else min(saves, max(kept, 2))
    model_dtype = (actor.get("fsdp_config") or {}).get("model_dtype") or "fp32"
    contents = (actor.get("checkpoint") or {}).get("save_contents") or ["model", "optimizer", "extra"]
    return CheckpointDisk(params=params, per_checkpoint=params * bytes_per_parameter(contents, model_dtype),
                          saves=saves, kept=kept, on_disk=on_disk, snapshots=len(set(stages)),
                          snapshot_bytes=params * HF_EXPORT_BYTES)


def parameter_count(model_dir: str) -> int:
    """Parameters of the Hugging Face model at ``model_dir``, built on the meta device (no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
