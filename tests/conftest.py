"""Suite-wide settings and fixtures.

Two shared cores: torch's default intra-op threading makes each tiny forward
pass tens of times slower when several processes compete, so every test
process uses one thread (Ray workers get OMP_NUM_THREADS=1 from the recipes).

The suite never joins a Ray cluster that happens to be running on the machine (a ``RAY_ADDRESS`` in the
caller's shell, or the address a ``ray start`` left in Ray's temp dir): ``RAY_ADDRESS=local`` is Ray's
"start a new local cluster", it reaches every subprocess the tests launch (the entry points then start their
own cluster), and the in-process fixture passes ``address="local"``. ``tests/cluster/`` starts its own
clusters explicitly.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["RAY_ADDRESS"] = "local"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.vllm`` tests run where vLLM is importable (``make test-vllm``), skip with a reason elsewhere."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed in this venv: run `make test-vllm` (CPU build in .venv-vllm)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_server(tiny, tmp_path_factory):
    """One vLLM OpenAI server on the tiny student for the whole session (start-up is ~2 min on 2 CPU cores):
    float32, LoRA rank <= 8 with runtime loading, ``VLLM_CPU_KVCACHE_SPACE=1`` on the CPU build."""
    from claas_verl.claas.service.vllm_launcher import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # max_model_len 2048 (the student's): room for the long in-flight request of the hot-reload test.
    with VLLMServer(tiny.student, served_model_name="tiny", max_model_len=2048, log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def tiny():
    """Offline tiny student, experts, tokenizer and data (built once, file-locked, reused across runs)."""
    from claas_verl.tiny import ensure_tiny

    return ensure_tiny()  # honours $CLAAS_TINY_DIR, default /tmp/claas_verl_tiny


def _hf_fp32(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_fp32():
    """``hf_fp32(path)``: an HF checkpoint loaded in float32, eval mode (the reference for vLLM's log-probs)."""
    return _hf_fp32


@pytest.fixture(scope="session")
def random_lora(tiny):
    """``random_lora(out_dir, seed)``: a random (not identity-initialised) rank-8 LoRA on the tiny student's q/v
    projections, saved with peft at ``out_dir`` and returned loaded on a float32 student."""

    def make(out, seed: int):
        from peft import PeftModel

        from claas_verl.tiny.adapters import random_lora_adapter

        random_lora_adapter(tiny.student, out, seed=seed, rank=8)
        return PeftModel.from_pretrained(_hf_fp32(tiny.student), str(out)).eval()

    return make


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for every in-process Ray test (starting one costs tens of seconds on 2 cores).

    Workers get the CPU platform and one thread each. End-to-end tests that launch verl's own
    entry points run them in a subprocess, which starts its own cluster as a user's job would.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "env_vars": {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            },
        )
    yield ray
    if started:
        ray.shutdown()


class ThreadAllReduce:
    """In-process stand-in for ``torch.distributed``: one thread per simulated rank, ``all_reduce`` in place.

    A real gloo pair takes about a minute to spawn on a loaded 2-core CI machine; threads exercise the
    same code path (every rank must call the same collectives in the same order, or the barrier hangs).
    """

    def __init__(self, world: int):
        import threading

        self.world, self.slots, self.calls = world, [None] * world, 0
        self.barrier = threading.Barrier(world, timeout=60)
        self.local = threading.local()

    def all_reduce(self, tensor, op=None, group=None):
        import torch.distributed as dist

        op = dist.ReduceOp.SUM if op is None else op
        assert op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX), op
        rank = self.local.rank
        self.slots[rank] = tensor.clone()
        if rank == 0:
            self.calls += 1
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        result = stacked.sum(0) if op == dist.ReduceOp.SUM else stacked.max(0).values
        self.barrier.wait()
        tensor.copy_(result)

    def run(self, fn):
        """Run ``fn(rank)`` on every simulated rank concurrently; return the per-rank results."""
        import threading

        out, errors = [None] * self.world, []

        def target(rank):
            self.local.rank = rank
            try:
                out[rank] = fn(rank)
            except Exception as e:  # re-raised below, after every thread stopped
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(k,)) for k in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


@pytest.fixture
def simulated_ranks(monkeypatch):
    """``simulated_ranks(world)`` patches torch.distributed with a :class:`ThreadAllReduce` and returns it."""
    import torch.distributed as dist

    def make(world: int) -> ThreadAllReduce:
        fake = ThreadAllReduce(world)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
        return fake

    return make


class TrackingLogs:
    """Where a run started with :attr:`overrides` (verl's console, wandb and tensorboard loggers) writes its
    metrics: wandb offline (``$WANDB_DIR``) and tensorboard (``$TENSORBOARD_DIR``), both under ``root``."""

    overrides = ("trainer.logger=[console,wandb,tensorboard]",)

    def __init__(self, root):
        self.wandb_dir, self.tensorboard_dir = root / "wandb_dir", root / "tensorboard"

    def wandb_keys(self) -> set[str]:
        """The history (step metric) keys of every offline wandb run, read from its ``run-*.wandb`` file."""
        import struct

        from wandb.proto import wandb_internal_pb2

        keys: set[str] = set()
        runs = sorted(self.wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
        assert runs, f"no offline wandb run under {self.wandb_dir}"
        for path in runs:
            data, pos, block, chunk = path.read_bytes(), 7, 32768, b""
            assert data[:4] == b":W&B", f"{path}: not a wandb transaction log"
            # wandb's log format: 32 KiB blocks of records (crc32, length, type), a record split over blocks
            # as FIRST/MIDDLE/LAST pieces (types 2, 3, 4; 1 = whole); a block's tail under 7 bytes is padding
            while pos + 7 <= len(data):
                left = block - pos % block
                if left < 7:
                    pos += left
                    continue
                _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
                if length == 0 and kind == 0:  # zero padding to the end of the block
                    pos += left
                    continue
                chunk += data[pos + 7:pos + 7 + length]
                pos += 7 + length
                if kind in (1, 4):
                    rec = wandb_internal_pb2.Record()
                    rec.ParseFromString(chunk)
                    chunk = b""
                    if rec.WhichOneof("record_type") == "history":
                        keys |= {it.key or "/".join(it.nested_key) for it in rec.history.item}
        return keys

    def tensorboard_keys(self) -> set[str]:
        """The scalar tags of the tensorboard event files."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        assert list(self.tensorboard_dir.glob("events.out.tfevents.*")), f"no event file in {self.tensorboard_dir}"
        acc = EventAccumulator(str(self.tensorboard_dir))
        acc.Reload()
        return set(acc.Tags()["scalars"])


@pytest.fixture
def tracking_logs(tmp_path, monkeypatch) -> TrackingLogs:
    """wandb (offline: no account, no network) and tensorboard write under ``tmp_path`` for the subprocesses and Ray
    workers this test starts; add :attr:`TrackingLogs.overrides` to the run's command line."""
    logs = TrackingLogs(tmp_path)
    logs.wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(logs.wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_DIR", str(logs.tensorboard_dir))
    return logs
