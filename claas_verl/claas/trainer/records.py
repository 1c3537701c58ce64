"""What a CLaaS run writes about itself: the trace (``claas_trace.jsonl``), warnings, counters, the served-policy
probe, and the end-of-run records (``continual_metrics.json`` or, service-driven, ``service_stats.json``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

TRACE_FILE = "claas_trace.jsonl"

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunCounters:
    """Updates done (k after the buffer's ``on_update``) and time spent waiting for the buffer to be ready."""

    updates: int = 0
    last_update_unix: float | None = None
    wait_s: float = 0.0
    last_wait_s: float = 0.0


class RunRecords:
    """The trace and the warnings of one run; trace lines come from the trainer thread and the producers' loop."""

    def __init__(self, out_dir: str, trace: bool):
        self.out_dir = out_dir
        self.enabled = trace
        self.t_start = time.time()
        self.warnings: list[str] = []
        self._lock = threading.Lock()

    @property
    def trace_path(self) -> str:
        return os.path.join(self.out_dir, TRACE_FILE)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        logger.warning(msg)

    def trace(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"t": round(time.time() - self.t_start, 3), **record}
        line = json.dumps(record, default=str) + "\n"
        with self._lock, open(self.trace_path, "a") as f:
            f.write(line)

    def wall_s(self) -> float:
        return time.time() - self.t_start

    def write_continual_metrics(self, matrix: list[list[float]], num_splits: int, buffer_stats: dict, extra: dict,
                                algorithm: str, a_max: int) -> None:
        """M (padded with NaN rows when the run stopped early), transfer metrics, buffer statistics."""
        from claas_verl.metrics import write_continual_metrics
        from claas_verl.metrics.continual import HEATMAP_PNG
        from claas_verl.utils.plots import plot_transfer_heatmap

        K = num_splits
        if len(matrix) != K:
            self.warn(f"only {len(matrix)} of {K} splits finished (claas.max_updates reached); M is partial")
            matrix = matrix + [[float("nan")] * K for _ in range(K - len(matrix))]
        extra = {**extra, "warnings": self.warnings}
        M = np.array(matrix, dtype=float)
        if np.isfinite(M).all():
            paths = write_continual_metrics(self.out_dir, M, buffer_stats=buffer_stats, extra=extra)
            plot_transfer_heatmap(M, Path(self.out_dir) / HEATMAP_PNG, title=f"CLaaS {algorithm}: M[j, k]")
        else:
            # A cell with no gradable step (or an unfinished protocol): record what exists, metrics null.
            self.warn("M has cells without any graded step (or unfinished splits); transfer metrics are not defined")
            extra["warnings"] = self.warnings
            record = {"M": [[v if math.isfinite(v) else None for v in row] for row in M.tolist()], "K": K,
                      "forward_transfer": None, "forgetting": None, "final": None,
                      "buffer_stats": buffer_stats, **extra}
            paths = {"json": Path(self.out_dir) / "continual_metrics.json"}
            paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
        fmt = lambda v: "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
        rec = json.loads(paths["json"].read_text())
        print(f"[claas] {extra['updates']} updates; forward_transfer={fmt(rec['forward_transfer'])} "
              f"forgetting={fmt(rec['forgetting'])} final={fmt(rec['final'])}; max entry uses="
              f"{buffer_stats['max_uses']} (A_max+1={a_max + 1}); metrics: {paths['json']}", flush=True)

    def write_service_stats(self, record: dict) -> Path:
        path = Path(self.out_dir) / "service_stats.json"
        path.write_text(json.dumps({**record, "warnings": self.warnings}, indent=2, default=str) + "\n")
        return path


def served_fingerprint(named: dict[str, torch.Tensor]) -> str:
    """sha1 over the served weights (sorted names, fp32 bytes): changes iff any served weight changes."""
    h = hashlib.sha1()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def served_weights_probe(llm_server_manager: Any) -> dict:
    """What each rollout replica serves (version, weight fingerprint, last push, LoRA state), for the trace."""
    out = {}
    for r, replica in enumerate(llm_server_manager.get_replicas()):
        server = replica.servers[0]
        if hasattr(server, "claas_lora_state"):  # verl's vLLM rollout with versioned LoRA updates
            out[f"served_lora_{r}"] = ray.get(server.claas_lora_state.remote())
        if not hasattr(server, "get_named_parameters"):
            continue
        version = ray.get(server.get_policy_version.remote())
        named = ray.get(server.get_named_parameters.remote())
        out[f"served_version_{r}"] = int(version)
        out[f"served_fingerprint_{r}"] = served_fingerprint(named)
        if hasattr(server, "get_last_update"):  # which tensors the latest push carried (adapter-only check)
            last = ray.get(server.get_last_update.remote())
            out[f"served_last_push_kind_{r}"] = last["kind"]
            out[f"served_last_push_names_{r}"] = last["names"]
    return out
