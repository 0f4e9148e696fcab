#!/usr/bin/env bash
# verl 0.9.x GRPO/DAPO-style run with CE-GPPO + ERC + entropylens per-token recording (what a GPU user launches).
#
#   pip install "verl==0.9.1" entropylens vllm     # the plug-in loads itself on `import verl`
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct DATA=$HOME/data/gsm8k RUNS=/shared/runs bash examples/verl/run_ce_gppo_erc.sh
#   entropylens report $RUNS/<run id>           # the run id is printed by the trainer and in $RUNS
#
# DATA holds train.parquet / test.parquet in verl's RL format (e.g. made by verl's
# examples/data_preprocess/gsm8k.py). RUNS must be writable by every actor worker (a shared filesystem
# on several nodes). Hyper-parameters follow the CE-GPPO paper's 1.5B setting (beta1 0.5, beta2 1.0,
# eps 0.2 / 0.2, dual-clip 10) and the ERC paper's band (0.95, 1.05).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
RUNS=${RUNS:-$PWD/entropylens-runs}
NGPUS=${NGPUS:-8}

python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=4096 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2 \
  actor_rollout_ref.actor.clip_ratio_c=10.0 \
  actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig \
  actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo \
  +actor_rollout_ref.actor.policy_loss.beta1=0.5 \
  +actor_rollout_ref.actor.policy_loss.beta2=1.0 \
  +actor_rollout_ref.actor.policy_loss.erc_low=0.95 \
  +actor_rollout_ref.actor.policy_loss.erc_high=1.05 \
  +actor_rollout_ref.actor.policy_loss.record_dir="$RUNS" \
  +actor_rollout_ref.actor.policy_loss.sample=0.1 \
  trainer.use_v1=true trainer.v1.trainer_mode=entropylens \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  trainer.n_gpus_per_node="$NGPUS" trainer.nnodes=1 \
  trainer.logger='["console"]' trainer.project_name=entropylens trainer.experiment_name=ce_gppo_erc \
  trainer.total_epochs=1 "$@"
