#!/usr/bin/env bash
# GPU smoke test of the continual MOPD trainer: 2 steps of a 3-stage tiny plan with vLLM rollouts and FSDP2.
#
#   bash examples/gpu_smoke_mopd.sh [extra key=value overrides]
#
# Needs a CUDA machine with the `gpu` extra installed (vllm). The tiny offline student/experts are built if
# missing. Logic gets a single block so the two steps cross a stage boundary: step 1 is stage 1 (teacher
# E_logic), step 2 is stage 2 (teacher E_math, fresh AdamW state, snapshot M_1 written in between).
# Passes when the run exits 0 and steps.jsonl holds the two planned steps.
# Then (unless SMOKE_FSAR=0) 5 steps of tiny FSAR on two domains: the 5th is a logic replay step taught by M_1
# with the balanced multi-pass update (SATS + VR + hidden, docs/math.md §B.6/B.7) inside the FSDP2 actor; it must log
# balancing parts in the ratio r = mopd.signal.ratio (2 here).
set -euo pipefail
cd "$(dirname "$0")/.."
export CLAAS_TINY_DIR="${CLAAS_TINY_DIR:-/tmp/claas_verl_tiny}"
export CLAAS_OUT_DIR="${CLAAS_OUT_DIR:-/tmp/claas_verl_gpu_smoke}"
NAME="gpu_smoke_mopd"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this smoke test needs a GPU')"
python -c "import vllm" || { echo "vllm is not installed: pip install -e '.[gpu]'" >&2; exit 2; }
python -m claas_verl.tiny make "$CLAAS_TINY_DIR"
rm -rf "${CLAAS_OUT_DIR:?}/${NAME}"

# the tiny models on one shared GPU: a small vLLM cache and token budgets (both runs)
GPU_SIZES=(
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096
)

python -m claas_verl.main_mopd --config-name mopd/replay_kl scale=tiny '+verl@_global_=gpu' \
  trainer.experiment_name="$NAME" trainer.n_gpus_per_node="${N_GPUS:-1}" \
  trainer.total_training_steps=2 trainer.save_freq=-1 trainer.resume_mode=disable \
  mopd.domains.logic.num_blocks=1 mopd.eval.prompts=2 \
  "${GPU_SIZES[@]}" \
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

if [ "${SMOKE_FSAR:-1}" != "0" ]; then
  rm -rf "${CLAAS_OUT_DIR:?}/${NAME}_fsar"
  python -m claas_verl.main_mopd --config-name mopd/fsar_shared scale=tiny mopd.signal.window=16 '+verl@_global_=gpu' \
    trainer.experiment_name="${NAME}_fsar" trainer.n_gpus_per_node="${N_GPUS:-1}" \
    trainer.save_freq=-1 trainer.resume_mode=disable \
    'mopd.order=[logic,math]' mopd.domains.logic.num_blocks=1 mopd.eval.enabled=false mopd.signal.ratio=2.0 \
    "${GPU_SIZES[@]}" \
    "$@"
  python - <<PY
import json, pathlib
run = pathlib.Path("$CLAAS_OUT_DIR") / "${NAME}_fsar"
steps = [json.loads(l) for l in (run / "steps.jsonl").read_text().splitlines() if l.strip()]
replay = [s for s in steps if s["kind"] == "replay"]
assert len(steps) == 5 and [(s["domain"], s["teacher"]) for s in replay] == [("logic", "student:1")], steps
m = replay[0]["metrics"]
ratio = m["actor/mopd/tok_part_norm"] / m["actor/mopd/aux_part_norm"]
assert abs(ratio - 2.0) < 1e-3 and m["actor/mopd/balance_fallback"] == 0, m
print("GPU FSAR smoke OK: balance scale", round(m["actor/mopd/balance_scale"], 4), "part ratio", round(ratio, 6))
PY
fi
