"""CLaaS, continual learning as a service: the system's glue on top of the shared math and verl glue.

``replay/`` the asynchronous replay-buffer Ray actor; ``envs/`` scenario environments and graders; ``service/`` the
chat API in front of the rollout servers; ``trainer/`` the asynchronous LoRA trainer on verl's v1 trainer;
``verl_losses`` the registrations of the CLaaS losses and advantages (``claas_verl.losses``) into verl;
``lora_versions`` / ``vllm_versioned_lora`` versioned LoRA serving inside verl's vLLM rollout, over the state
machine in ``adapter_switch``. The math is in docs/math.md, Part A.
"""
