#!/usr/bin/env bash
# The runs of benchmarks/plans/mopd_replay.md (#56), as the plan's "Commands" section spells them, resumable.
#
#   bash benchmarks/mopd_replay_queue.sh PART...     # parts run one after the other (amendment 5: one job at a time)
#   bash benchmarks/mopd_replay_queue.sh copy        # copy what finished into benchmarks/results/ (then commit)
#
# Parts: proxy-check and trainer-check (one committed run made again here and compared), trainer-e2-o2,
# proxy-e1-3e-4, proxy-mech, proxy-machine (amendment 7), trainer-e1-3e-4, trainer-machine (amendment 8),
# trainer-e3a / -e3b / -e5 (the promoted mechanism arms), proxy-e1-1e-4; complete ones (trainer-e1-1e-3,
# trainer-e2-o1, proxy-e1-1e-3, proxy-e2)
# find every run committed. Work goes to $I56_DIR (default /tmp/claas_verl_i56). A run committed under
# benchmarks/results/ is not run again: a trainer directory starts from the committed results.json (continual.py
# resumes from it, bundle fingerprint checked); a proxy run is skipped when its JSON exists in a committed folder
# (`i56_proxy/*/`) or in the work folder. The stage proxy runs $I56_PROXY_JOBS processes at once (default 2, one
# thread each; every step seeds its own samples, so only the wall time depends on it).
set -euo pipefail
cd "${I56_REPO:-$(dirname "$0")/..}"
PY=${PYTHON:-$PWD/.venv/bin/python}
DIR=${I56_DIR:-/tmp/claas_verl_i56}
PROXY_JOBS=${I56_PROXY_JOBS:-2}
RES=${I56_RESULTS:-benchmarks/results}  # the committed records
SEEDS_TRAINER=31,32,33,34,35,36,37,38,39
SEEDS_PROXY="10 11 12 13 14 15 16 17 18"
O2_TRAINER="mopd.order=[palin,reverse,spell]"
O2_PROXY="--order palin,reverse,spell"
mkdir -p "$DIR"

# trainer DIR_NAME COMMITTED_NAME RECIPES OVERRIDES...: one continual.py benchmark, resumed from the committed records
trainer() {
  local name=$1 committed=$2 recipes=$3; shift 3
  local out=$DIR/$name
  if [[ ${I56_DRY:-0} == 1 ]]; then  # the command, one line, committed records not copied
    echo "continual.py --recipes $recipes --seeds $SEEDS_TRAINER --jobs 2 --keep-step-logs --out $out" \
      "mopd.probe.enabled=true $*" | sed 's/ *$//'
    return 0
  fi
  if [[ ! -f $out/results.json && -f $RES/$committed/results.json ]]; then
    mkdir -p "$out" && cp -r "$RES/$committed/." "$out/"
  fi
  PATH="$(dirname "$PY"):$PATH" "$PY" benchmarks/continual.py --recipes "$recipes" --seeds $SEEDS_TRAINER --jobs 2 \
    --keep-step-logs --out "$out" mopd.probe.enabled=true "$@"
}

# proxy_line SUBDIR ARM LR N ORDER SEED FLAGS...: one queue line "out-json flags" unless the run exists
proxy_line() {
  local sub=$1 arm=$2 lr=$3 n=$4 o=$5 s=$6; shift 6
  local name=${arm}_lr${lr}_n${n}_o${o}_s${s}
  # a committed run counts wherever it sits (the paper's replay at 1e-3 is E2's reference, in e2/)
  compgen -G "$RES/i56_proxy/*/$name.json" > /dev/null && return 0
  [[ -f $DIR/proxy/$sub/$name.json ]] && return 0
  local line=("$DIR/proxy/$sub/$name" --seed "$s" --lr "$lr" --steps "$n")
  [[ $o == 2 ]] && line+=($O2_PROXY)
  # no trailing blank: `xargs -L 1` would join the next line to this one
  echo "${line[*]} $*" | sed 's/ *$//'
}

# proxy_arm SUBDIR ARM LR N FLAGS...: the arm on seeds 10-18 in both orders
proxy_arm() {
  local sub=$1 arm=$2 lr=$3 n=$4; shift 4
  for o in 1 2; do for s in $SEEDS_PROXY; do proxy_line "$sub" "$arm" "$lr" "$n" "$o" "$s" "$@"; done; done
}

run_proxy_queue() {  # stdin: queue lines; each run writes NAME.json and NAME.log (I56_DRY=1: print the lines)
  if [[ ${I56_DRY:-0} == 1 ]]; then cat; return; fi
  mkdir -p "$DIR/proxy"/{e1,e2,mech,machine}
  xargs -P "$PROXY_JOBS" -L 1 bash -c \
    'out=$0; "'"$PY"'" benchmarks/mopd_stage_proxy.py --json "$out.json.part" "$@" > "$out.log" 2>&1 \
       && mv "$out.json.part" "$out.json" || echo "FAILED: $out (see $out.log)" >&2'
}

proxy_e1() {  # LR N: Seq, the paper's replay, floor
  proxy_arm e1 seq "$1" "$2"
  proxy_arm e1 paper "$1" "$2" --replay-every 3
  proxy_arm e1 floor "$1" "$2" --replay-every 3 --replay-std-floor 0.3
}

proxy_mech() {  # E3a, E3b, E4 (c = ĉ), E5, E4 (c = 0.3) at lr 1e-3, n = 12; arm by arm, so a cut leaves whole arms
  proxy_arm mech seq_b0 1e-3 12 --beta1 0
  proxy_arm mech paper_b0 1e-3 12 --beta1 0 --replay-every 3
  proxy_arm mech e3b 1e-3 12 --replay-every 3 --replay-optimizer separate
  proxy_arm mech e4c0.196 1e-3 12 --replay-every 3 --replay-weight 0.196
  proxy_arm mech e5 1e-3 12 --replay-every 3 --replay-cycle reversed
  proxy_arm mech e4c0.3 1e-3 12 --replay-every 3 --replay-weight 0.3
}

proxy_machine() {  # amendment 7's control: the lr 1e-3 references made again on this machine, under their own names
  proxy_arm machine seq_rerun 1e-3 12
  proxy_arm machine paper_rerun 1e-3 12 --replay-every 3
}

LR3E4=(mopd.train.lr=3e-4 mopd.domains.reverse.num_blocks=40 mopd.domains.spell.num_blocks=40
       mopd.domains.palin.num_blocks=40)
ALL3=mopd/gym_seq,mopd/gym_replay_kl,mopd/gym_replay_kl_floor
BETA1_0="mopd.train.betas=[0.0,0.999]"  # E3a: no first moment, AdamW's second moment as the paper's

copy_results() {
  local name
  for name in e1_lr1e-3_o1 e1_lr1e-3_o2 e2_o1 e2_o2 e1_lr3e-4_o1 e1_lr3e-4_o2 {e1rerun,e3a,e3b,e5}_o{1,2}; do
    [[ -f $DIR/$name/results.json ]] || continue
    mkdir -p "$RES/i56_$name/steps"
    # an unfinished directory has no report yet (continual.py writes it when every run is done)
    for f in results.json report.md reference_scores.json; do
      if [[ -f $DIR/$name/$f ]]; then cp "$DIR/$name/$f" "$RES/i56_$name/"; fi
    done
    cp "$DIR/$name"/steps/*.jsonl.gz "$RES/i56_$name/steps/" 2>/dev/null || true
  done
  if [[ -f $DIR/check_trainer/check.txt ]]; then  # amendment 8's check: its run and the comparison
    mkdir -p "$RES/i56_trainer_check/steps"
    cp "$DIR/check_trainer"/{results.json,report.md,check.txt} "$RES/i56_trainer_check/"
    cp "$DIR/check_trainer"/steps/*.jsonl.gz "$RES/i56_trainer_check/steps/"
  fi
  for sub in e1 e2 mech machine; do
    compgen -G "$DIR/proxy/$sub/*.json" > /dev/null || continue
    mkdir -p "$RES/i56_proxy/$sub"
    for f in "$DIR/proxy/$sub"/*.json; do cp "$f" "${f%.json}.log" "$RES/i56_proxy/$sub/"; done
  done
}

# proxy_check: run one committed proxy run again here and compare it with its record (is this machine's arithmetic the
# one the committed runs were made with? A difference does not void a pairing, it is reported next to it)
proxy_check() {
  local name=paper_lr1e-3_n12_o1_s10 out=$DIR/proxy/check
  mkdir -p "$out"
  "$PY" benchmarks/mopd_stage_proxy.py --json "$out/$name.json" --seed 10 --lr 1e-3 --steps 12 --replay-every 3 \
    > "$out/$name.log" 2>&1
  "$PY" - "$RES/i56_proxy/e2/$name.json" "$out/$name.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
steps = list(zip(a["steps"], b["steps"]))
first = next((i for i, (x, y) in enumerate(steps) if x["metrics"] != y["metrics"]), None)
print(f"proxy check: {sys.argv[1]} (committed) against {sys.argv[2]} (here)")
if first is None:
    print("  every step's metrics identical")
else:
    x, y = steps[first][0]["metrics"], steps[first][1]["metrics"]
    rel = max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for k in x if k in y)
    print(f"  first step whose metrics differ: {first} (largest relative difference {rel:.1e})")
for key in ("stage_scores", "metrics"):
    print(f"  {key}: committed {a[key]}\n  {' ' * len(key)}  here      {b[key]}")
PYEOF
}

# trainer_check: the same for the trainer (amendment 8): Seq, seed 31, default order, lr 1e-3, against trainer E1's
# record; every step's metrics and the run's forgetting (run again, it only compares: continual.py resumes)
trainer_check() {
  local out=$DIR/check_trainer committed=$RES/i56_e1_lr1e-3_o1
  if [[ ${I56_DRY:-0} == 1 ]]; then
    echo "continual.py --recipes mopd/gym_seq --seeds 31 --jobs 1 --keep-step-logs --out $out mopd.probe.enabled=true"
    return 0
  fi
  PATH="$(dirname "$PY"):$PATH" "$PY" benchmarks/continual.py --recipes mopd/gym_seq --seeds 31 --jobs 1 \
    --keep-step-logs --out "$out" mopd.probe.enabled=true
  "$PY" - "$committed" "$out" <<'PYEOF' | tee "$out/check.txt"
import gzip, json, sys
from pathlib import Path
a, b = (Path(p) for p in sys.argv[1:])
steps = [[json.loads(x) for x in gzip.open(d / "steps" / "mopd_gym_seq_s31.jsonl.gz", "rt")] for d in (a, b)]
runs = [next(r for r in json.loads((d / "results.json").read_text())["runs"]
             if r["recipe"] == "mopd/gym_seq" and r["seed"] == 31) for d in (a, b)]
print(f"trainer check: {a} (committed) against {b} (here), mopd/gym_seq seed 31")
def learned(metrics):  # what the step computed; wall times and memory differ between any two runs
    return {k: v for k, v in metrics.items() if not any(t in k for t in ("perf/", "timing"))}
first = next((i for i, (x, y) in enumerate(zip(*steps)) if learned(x["metrics"]) != learned(y["metrics"])), None)
if first is None:
    print(f"  every step's metrics identical ({len(steps[0])} and {len(steps[1])} steps)")
else:
    x, y = learned(steps[0][first]["metrics"]), learned(steps[1][first]["metrics"])
    rel = {k: abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for k in x if k in y and x[k] != y[k]}
    worst = max(rel, key=rel.get)
    print(f"  first step whose metrics differ: {first}, on {len(rel)} of {len(x)} metrics (largest relative "
          f"difference {rel[worst]:.1e}, {worst}; actor/grad_norm {rel.get('actor/grad_norm', 0.0):.1e})")
for key in ("forgetting", "final_avg", "stage_scores"):
    print(f"  {key}: committed {runs[0][key]}\n  {' ' * len(key)}  here      {runs[1][key]}")
print(f"  host here: {runs[1].get('host')}")
PYEOF
}

main() {
for part in "$@"; do
  echo "== $(date -u +%H:%M) $part"
  case $part in
    trainer-e1-1e-3) trainer e1_lr1e-3_o1 i56_e1_lr1e-3_o1 $ALL3
                     trainer e1_lr1e-3_o2 i56_e1_lr1e-3_o2 $ALL3 "$O2_TRAINER" ;;
    trainer-e2-o1) trainer e2_o1 i56_e2_o1 mopd/gym_replay_kl mopd.train.replay_responses_per_prompt=16 ;;
    trainer-e2-o2) trainer e2_o2 i56_e2_o2 mopd/gym_replay_kl mopd.train.replay_responses_per_prompt=16 \
                     "$O2_TRAINER" ;;
    trainer-e1-3e-4) trainer e1_lr3e-4_o1 i56_e1_lr3e-4_o1 $ALL3 "${LR3E4[@]}"
                     trainer e1_lr3e-4_o2 i56_e1_lr3e-4_o2 $ALL3 "${LR3E4[@]}" "$O2_TRAINER" ;;
    # the mechanism arms the proxy promoted (plan, "Promotion to the trainer"; amendment 8): lr 1e-3, both orders
    trainer-e3a) trainer e3a_o1 i56_e3a_o1 mopd/gym_seq,mopd/gym_replay_kl "$BETA1_0"
                 trainer e3a_o2 i56_e3a_o2 mopd/gym_seq,mopd/gym_replay_kl "$BETA1_0" "$O2_TRAINER" ;;
    trainer-e3b) trainer e3b_o1 i56_e3b_o1 mopd/gym_replay_kl mopd.train.replay_optimizer=separate
                 trainer e3b_o2 i56_e3b_o2 mopd/gym_replay_kl mopd.train.replay_optimizer=separate "$O2_TRAINER" ;;
    trainer-e5) trainer e5_o1 i56_e5_o1 mopd/gym_replay_kl mopd.replay.cycle=reversed
                trainer e5_o2 i56_e5_o2 mopd/gym_replay_kl mopd.replay.cycle=reversed "$O2_TRAINER" ;;
    proxy-e1-1e-3) proxy_e1 1e-3 12 | run_proxy_queue ;;
    proxy-e1-3e-4) proxy_e1 3e-4 40 | run_proxy_queue ;;
    proxy-e1-1e-4) proxy_e1 1e-4 120 | run_proxy_queue ;;
    proxy-e2) { proxy_arm e2 paper 1e-3 12 --replay-every 3
                proxy_arm e2 e2 1e-3 12 --replay-every 3 --replay-replies 16; } | run_proxy_queue ;;
    proxy-mech) proxy_mech | run_proxy_queue ;;
    proxy-machine) proxy_machine | run_proxy_queue ;;
    proxy-check) proxy_check ;;
    trainer-check) trainer_check ;;
    # amendment 8's control: trainer E1's Seq and paper's replay at lr 1e-3 made again on this machine
    trainer-machine) trainer e1rerun_o1 i56_e1rerun_o1 mopd/gym_seq,mopd/gym_replay_kl
                     trainer e1rerun_o2 i56_e1rerun_o2 mopd/gym_seq,mopd/gym_replay_kl "$O2_TRAINER" ;;
    copy) copy_results ;;
    *) echo "unknown part '$part': see the header of $0" >&2; exit 2 ;;
  esac
done
}

# main is parsed whole before it runs, so editing this file while a queue runs cannot change that queue
main "$@"; exit $?
