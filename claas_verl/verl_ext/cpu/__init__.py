"""verl on CPU: a platform (gloo, device ``cpu``), an HF transformers rollout and the few patches they need.

Nothing here is imported by ``import claas_verl``; the verl plugin (``claas_verl.verl_ext.plugin``)
loads ``platform`` and ``patches``, and the ``hf`` rollout (``hf_replica``, which loads ``hf_rollout`` and
``hf_decode``) is imported lazily by verl's registries.
"""
