"""CLaaS chat service (CLaaS paper §3: agents talk to the inference server; every turn feeds the replay buffer).

An OpenAI-compatible ``/v1/chat/completions`` in front of an inference backend (vLLM through
:class:`OpenAIBackend`, or the in-process :class:`HFBackend` on CPU) that records each assistant turn as a
:class:`~claas_verl.claas.replay.ReplayEntry` once its reward is known, and hot-reloads LoRA adapters
(:class:`VLLMLoRAClient`, :class:`AdapterSwitch`) so that every entry carries the policy version that produced it.

Heavy modules (torch/transformers for ``HFBackend``, FastAPI/uvicorn, httpx) are imported only when used.
"""

from claas_verl.claas.service.app import ChatService
from claas_verl.claas.service.backend import BackendError, ChatBackend, Generation
from claas_verl.claas.service.config import ServiceConfig
from claas_verl.claas.service.grading import GradeRequest, normalize_grade, verifier_grader
from claas_verl.claas.service.guard import scenario_key_to_id
from claas_verl.claas.service.http_app import build_app
from claas_verl.claas.service.lora_reload import AdapterLease, AdapterSwitch, LoRAReloadError, Served, VLLMLoRAClient
from claas_verl.claas.service.recorder import COUNTERS, TrajectoryRecorder, TurnRecord, behaviour_logprob
from claas_verl.claas.service.sampling import TRAINING_SAMPLING, SamplingParams, training_violations
from claas_verl.claas.service.sinks import ActorSink, LocalBufferSink, make_sink
from claas_verl.claas.service.streaming import IncrementalDetokenizer, StreamStart, TokenDelta

_LAZY = {
    "HFBackend": "claas_verl.claas.service.hf_backend",
    "OpenAIBackend": "claas_verl.claas.service.openai_backend",
    "TenantHFBackend": "claas_verl.claas.service.hf_tenants",
    "TenantOpenAIBackend": "claas_verl.claas.service.openai_tenants",
    "ServiceThread": "claas_verl.claas.service.server",
    "ClaasServiceClient": "claas_verl.claas.service.client",
    "ClaasServiceError": "claas_verl.claas.service.client",
}

__all__ = [
    "ActorSink", "AdapterLease", "AdapterSwitch", "BackendError", "COUNTERS", "ChatBackend", "ChatService",
    "ClaasServiceClient", "ClaasServiceError", "Generation", "GradeRequest", "HFBackend", "IncrementalDetokenizer",
    "LoRAReloadError", "LocalBufferSink", "OpenAIBackend", "SamplingParams", "Served", "ServiceConfig",
    "ServiceThread", "StreamStart", "TRAINING_SAMPLING", "TenantHFBackend", "TenantOpenAIBackend", "TokenDelta",
    "TrajectoryRecorder", "TurnRecord", "VLLMLoRAClient", "behaviour_logprob", "build_app", "make_sink",
    "normalize_grade", "scenario_key_to_id", "training_violations", "verifier_grader",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'claas_verl.claas.service' has no attribute {name!r}")
