"""Training-data preparation from local raw datasets: ``python -m claas_verl.mopd.data mopd --out DIR ...``."""
