#!/usr/bin/env bash
# GPU smoke check of the verl plug-in (one GPU, offline, ~5 min): 3 PPO steps of a tiny Qwen2 with
# CE-GPPO + ERC + recording through verl 0.9.1's v1 trainer (FSDP engine, vLLM rollout), then checks
# the recorded run and renders `entropylens report`. Exit 0 = every check passed.
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
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=3 trainer.val_before_train=false \
  trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger='["console"]' \
  trainer.project_name=entropylens trainer.experiment_name=gpu_check 2>&1 | tee "$work/train.log"

grep -q "entropylens/clipped_frac" "$work/train.log" || { echo "FAIL: no entropylens/ metrics in verl's log"; exit 1; }
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
entropylens report "$runs/gpu-check" --out "$work/report"
test -s "$work/report/index.html"
echo "OK: $work"
