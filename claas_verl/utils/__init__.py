"""Small helpers shared across the package, none of them importing Ray or verl: ``masked`` and ``host_sync``
(torch-only, for the math modules: aggregation, the debug flag of the value checks, one host read of a metrics dict),
``cli`` (the ``python -m claas_verl.*`` commands), ``hf_quiet`` (Hugging Face progress bars)."""
