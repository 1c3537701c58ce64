#!/usr/bin/env bash
# GRPO with verl's own trainer (main_ppo) on the tiny offline model, on CPU (2 cores: a few minutes).
# Usage: examples/tiny_grpo_cpu.sh [extra Hydra overrides, e.g. trainer.total_training_steps=10 trainer.logger='[console,wandb]']
# wandb offline: WANDB_MODE=offline examples/tiny_grpo_cpu.sh trainer.logger='[console,wandb]'
set -euo pipefail
cd "$(dirname "$0")/.."
export CLAAS_TINY_DIR="${CLAAS_TINY_DIR:-/tmp/claas_verl_tiny}"
[ -f "$CLAAS_TINY_DIR/student/config.json" ] || python -m claas_verl.tiny make "$CLAAS_TINY_DIR"
exec python -m verl.trainer.main_ppo --config-path="$PWD/recipes/ppo" --config-name=tiny_grpo +cpu=default "$@"
