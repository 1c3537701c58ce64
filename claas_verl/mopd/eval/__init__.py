"""Benchmark evaluation of MOPD checkpoints with the MOPD paper's settings (App. C) and the report of its table.

``python -m claas_verl.mopd.eval --model ... --benchmarks ... --seeds 0,1,2 --out OUT`` then
``python -m claas_verl.mopd.eval report --runs OUT``. Heavy libraries (lm-eval, reasoning-gym, math-verify,
evalplus, vLLM) are imported inside the functions that use them.
"""
