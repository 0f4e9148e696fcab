#!/usr/bin/env bash
# GPU smoke check of the verl plug-in (one GPU, offline, ~8 min): 3 PPO steps of a tiny Qwen2 with
# CE-GPPO + ERC + recording through verl 0.9.1's v1 trainer (FSDP engine, vLLM rollout), checkpoints
# at steps 2 and 3; then a second job resumes from checkpoint 3 and trains step 4 into the same run.
# Checks the recorded run (every step once, the resume in run.json) and renders `entropylens report`.
# Exit 0 = every check passed.
#
#   pip install torch "verl==0.9.1" vllm -e .     # on the GPU machine
#   bash examples/verl/gpu_check.sh [WORKDIR]
#
# Not runnable on CPU: verl 0.9.1 registers its FSDP engine for cuda/npu only and its v1 trainer
# generates through LLM-server replicas (vllm / sglang / trtllm), which need a GPU.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:-$(mktemp -d)}"
python "$here/make_tiny.py" "$work"
runs="$work/runs"

source "$here/tiny_overrides.sh"
train() {  # verl with the plug-in; extra overrides in "$@"
  verl_tiny_overrides "$work" "$runs" gpu-check
  python3 -m verl.trainer.main_ppo "${VERL_TINY[@]}" trainer.save_freq=2 trainer.resume_mode=auto \
    trainer.logger='["console"]' trainer.experiment_name=gpu_check "$@"
}

train trainer.total_training_steps=3 2>&1 | tee "$work/train.log"
grep -q "entropylens/clipped_frac" "$work/train.log" || { echo "FAIL: no entropylens/ metrics in verl's log"; exit 1; }
test -s "$work/checkpoints/global_step_3/entropylens.json" || { echo "FAIL: checkpoint 3 names no run"; exit 1; }
python - "$runs/gpu-check" <<'PY'
import sys
from entropylens.read import query
con = query.connect(sys.argv[1])
n, steps, lgn, rho, ids = con.execute(
    "select count(*), count(distinct step), count(logit_grad_norm), count(entropy_ratio), count(distinct seq) "
    "from tokens").fetchone()
print(f"rows={n} steps={steps} logit_grad_norm={lgn} entropy_ratio={rho} sequences={ids}")
assert n > 0 and steps == 3, "expected token rows for 3 steps"
assert lgn == n and rho == n, "every row needs logit_grad_norm and entropy_ratio"
erc = con.execute("select min(erc_drop_frac), max(erc_drop_frac) from steps").fetchone()
assert erc[0] is not None, "ERC aggregates missing"
print("erc_drop_frac range", erc)
PY
# a restarted job (here: one more step) resumes from checkpoint 3 and continues the same run
train trainer.total_training_steps=4 2>&1 | tee "$work/train2.log"
grep -q "entropylens: run 'gpu-check' continues after step 3" "$work/train2.log" \
  || { echo "FAIL: the restarted job did not continue the run"; exit 1; }
python - "$runs/gpu-check" <<'PY'
import json, sys
from entropylens.read import query
con = query.connect(sys.argv[1])
steps = [s for (s,) in con.execute("select distinct step from steps order by step").fetchall()]
twice = con.execute("select count(*) - count(distinct (step, seq, pos)) from tokens").fetchone()[0]
resumed = [r["after_step"] for r in json.load(open(sys.argv[1] + "/run.json"))["resumed"]]
print(f"steps={steps} rows_twice={twice} resumed_after={resumed}")
assert steps == [1, 2, 3, 4] and twice == 0 and resumed == [3], "expected steps 1-4 once, one resume after 3"
PY
entropylens report "$runs/gpu-check" --out "$work/report"
test -s "$work/report/index.html"
echo "OK: $work"
