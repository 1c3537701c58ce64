"""CLaaS, continual learning as a service: the system's glue on top of the shared math and verl glue.

``replay/`` the asynchronous replay-buffer Ray actor; ``envs/`` scenario environments and graders; ``service/`` the
chat API in front of the rollout servers; ``trainer/`` the asynchronous LoRA trainer on verl's v1 trainer;
``verl_losses`` the registrations of the CLaaS losses and advantages (``claas_verl.losses``) into verl;
``lora_versions`` / ``vllm_versioned_lora`` versioned LoRA serving inside verl's vLLM rollout, over the state
machine in ``adapter_switch``. The math is in docs/math.md, Part A.

Importing this package schedules the CLaaS names in verl's registries (``claas_seq_is``, ``claas_seq_is_product``,
``claas_rpp_ema``, ``claas_rpp_global_whiten``) for the moment verl's ``core_algos`` is imported; it imports no verl
itself.
"""

from claas_verl.verl_ext import register_when_verl_loads


def _register_with_verl() -> None:
    from claas_verl.claas import verl_losses  # noqa: F401  (its decorators register the names)


register_when_verl_loads(_register_with_verl)
