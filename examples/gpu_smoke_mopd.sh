#!/usr/bin/env bash
# GPU smoke test of the continual MOPD trainer: 2 steps of a 3-stage tiny plan with vLLM rollouts and FSDP2.
#
#   bash examples/gpu_smoke_mopd.sh [extra key=value overrides]
#
# Needs a CUDA machine with the `gpu` extra installed (vllm). The tiny offline student/experts are built if
# missing. Logic gets a single block so the two steps cross a stage boundary: step 1 is stage 1 (teacher
# E_logic), step 2 is stage 2 (teacher E_math, fresh AdamW state, snapshot M_1 written in between).
# Passes when the run exits 0 and steps.jsonl holds the two planned steps.
set -euo pipefail
cd "$(dirname "$0")/.."
export CLAAS_TINY_DIR="${CLAAS_TINY_DIR:-/tmp/claas_verl_tiny}"
export CLAAS_OUT_DIR="${CLAAS_OUT_DIR:-/tmp/claas_verl_gpu_smoke}"
NAME="gpu_smoke_mopd"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this smoke test needs a GPU')"
python -c "import vllm" || { echo "vllm is not installed: pip install -e '.[gpu]'" >&2; exit 2; }
python -m claas_verl.tiny make "$CLAAS_TINY_DIR"
rm -rf "${CLAAS_OUT_DIR:?}/${NAME}"

python -m claas_verl.main_mopd --config-name mopd/tiny_replay_kl '+verl@_global_=gpu' \
  trainer.experiment_name="$NAME" trainer.n_gpus_per_node="${N_GPUS:-1}" \
  trainer.total_training_steps=2 trainer.save_freq=-1 trainer.resume_mode=disable \
  mopd.domains.logic.num_blocks=1 mopd.eval.prompts=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096 \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096 \
  "$@"

python - <<PY
import json, pathlib
run = pathlib.Path("$CLAAS_OUT_DIR") / "$NAME"
steps = [json.loads(l) for l in (run / "steps.jsonl").read_text().splitlines() if l.strip()]
got = [(s["stage"], s["kind"], s["domain"], s["block"], s["teacher"]) for s in steps]
want = [(1, "new", "logic", 0, "expert:logic"), (2, "new", "math", 0, "expert:math")]
assert got == want, got
assert (run / "snapshots" / "student_1" / "config.json").exists()
print("GPU smoke OK:", got, "kl_topk", [round(s["metrics"]["mopd/kl_topk"], 4) for s in steps])
PY
