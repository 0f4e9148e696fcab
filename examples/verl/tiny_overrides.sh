# The verl 0.9.1 command line both GPU checks train with (sourced by examples/verl/gpu_check.sh and
# examples/gpu_check_verl.sh): a tiny Qwen2 from examples/verl/make_tiny.py, GRPO advantages, vLLM
# rollout on one GPU, CE-GPPO (beta 0.5 / 1) + ERC (0.95, 1.05) recorded by trainer_mode=entropylens.
#   verl_tiny_overrides WORK RUNS RUN   -> sets the array VERL_TINY (append your own overrides)
verl_tiny_overrides() {
  local work="$1" runs="$2" run="$3"
  VERL_TINY=(
    algorithm.adv_estimator=grpo
    data.train_files="$work/train.parquet" data.val_files="$work/test.parquet"
    data.train_batch_size=8 data.max_prompt_length=16 data.max_response_length=8
    actor_rollout_ref.model.path="$work/model"
    actor_rollout_ref.actor.optim.lr=5e-3
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2
    actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo
    +actor_rollout_ref.actor.policy_loss.beta1=0.5 +actor_rollout_ref.actor.policy_loss.beta2=1.0
    +actor_rollout_ref.actor.policy_loss.erc_low=0.95 +actor_rollout_ref.actor.policy_loss.erc_high=1.05
    +actor_rollout_ref.actor.policy_loss.record_dir="$runs" +actor_rollout_ref.actor.policy_loss.run="$run"
    trainer.use_v1=true trainer.v1.trainer_mode=entropylens
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3
    actor_rollout_ref.rollout.enforce_eager=true
    reward.custom_reward_function.path="$work/reward.py"
    trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.val_before_train=false trainer.test_freq=-1
    trainer.default_local_dir="$work/checkpoints" trainer.project_name=entropylens
  )
}
