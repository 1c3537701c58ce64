"""Small helpers shared across the package, none of them importing Ray or verl: ``masked`` (torch-only, for the
math modules), ``cli`` (the ``python -m claas_verl.*`` commands), ``hf_quiet`` (Hugging Face progress bars)."""
