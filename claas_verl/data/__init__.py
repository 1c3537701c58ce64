"""Training-data preparation from local raw datasets: ``python -m claas_verl.data mopd --out DIR ...``."""
