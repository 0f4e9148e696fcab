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

train() {  # verl with the plug-in; extra overrides in "$@"
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$work/train.parquet" data.val_files="$work/test.parquet" \
  data.train_batch_size=8 data.max_prompt_length=16 data.max_response_length=8 \
  actor_rollout_ref.model.path="$work/model" \
  actor_rollout_ref.actor.optim.lr=5e-3 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2 \
  actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig \
  actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo \
  +actor_rollout_ref.actor.policy_loss.beta1=0.5 +actor_rollout_ref.actor.policy_loss.beta2=1.0 \
  +actor_rollout_ref.actor.policy_loss.erc_low=0.95 +actor_rollout_ref.actor.policy_loss.erc_high=1.05 \
  +actor_rollout_ref.actor.policy_loss.record_dir="$runs" +actor_rollout_ref.actor.policy_loss.run=gpu-check \
  trainer.use_v1=true trainer.v1.trainer_mode=entropylens \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
  actor_rollout_ref.rollout.enforce_eager=true \
  reward.custom_reward_function.path="$work/reward.py" \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.val_before_train=false \
  trainer.test_freq=-1 trainer.save_freq=2 trainer.default_local_dir="$work/checkpoints" trainer.resume_mode=auto \
  trainer.logger='["console"]' trainer.project_name=entropylens trainer.experiment_name=gpu_check "$@"
}

train trainer.total_training_steps=3 2>&1 | tee "$work/train.log"
grep -q "entropylens/clipped_frac" "$work/train.log" || { echo "FAIL: no entropylens/ metrics in verl's log"; exit 1; }
test -s "$work/checkpoints/global_step_3/entropylens.json" || { echo "FAIL: checkpoint 3 names no run"; exit 1; }
python - "$runs/gpu-check" <<'PY'
import sys
from entropylens import query
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
from entropylens import query
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
