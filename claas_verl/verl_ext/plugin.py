"""verl plugin entry point (``verl.plugins`` group in setup.py; fallback: ``VERL_USE_EXTERNAL_MODULES``).

verl imports this module from inside ``verl/__init__.py`` in the driver and in
every Ray worker. Only cheap, safe things happen now:

1. the CPU platform is registered with ``PlatformRegistry`` (it is chosen when
   ``VERL_PLATFORM=cpu`` or when no accelerator is found);
2. post-import hooks are installed (``claas_verl.verl_ext.cpu.patches``) that
   register the HF rollout, the CPU FSDP engines and the gloo backend fix the
   moment verl imports the modules they touch;
3. inside a vLLM process, vLLM's CPU linear layers keep their weights, so verl's in-place full-weight sync
   can load into them (``claas_verl.verl_ext.cpu.vllm_weight_sync``; a no-op on GPUs);
4. claas_verl's losses are registered (each system schedules its own, see ``claas_verl.verl_ext``) as
   soon as ``verl.trainer.ppo.core_algos`` is imported, so the names resolve in
   every worker.

verl swallows plugin exceptions (logged at DEBUG), so failures here are logged
as errors before being re-raised.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from claas_verl.verl_ext.cpu import platform as _platform  # noqa: F401  (registers "cpu")
    from claas_verl.verl_ext.cpu.checks import guard_auto_set_device
    from claas_verl.verl_ext.cpu.patches import install_hooks
    from claas_verl.verl_ext.cpu.vllm_weight_sync import VLLM_GEMM_MODULE, keep_cpu_linear_weights
    from claas_verl.verl_ext.import_hooks import when_imported

    install_hooks()  # importing claas_verl (done above, as our parent package) already scheduled the losses
    when_imported("verl.trainer.main_ppo", guard_auto_set_device)  # P5: trainer.device checked before Ray
    when_imported(VLLM_GEMM_MODULE, keep_cpu_linear_weights)  # V4: full-weight syncs into vLLM's CPU build


try:
    load()
except Exception:  # pragma: no cover - re-raised; the log line is what a user sees under verl's silent loader
    logger.exception("claas_verl's verl plugin failed to load; the CPU platform and 'hf' rollout are unavailable")
    raise
