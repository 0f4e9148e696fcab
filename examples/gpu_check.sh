#!/usr/bin/env bash
# One script for a machine with one NVIDIA GPU (about 8 minutes): prints what a CPU machine cannot
# measure. Run from the repository root with the project's venv active (README's install command).
#   1. record_update under torch.cuda.set_sync_debug_mode("error"): no host sync but the one copy
#      (the CUDA-only tests, skipped on CPU);
#   2. TRL's fused-head step with and without recording (time and peak-memory ratios; KL and the
#      top-entropy mask on; loss="dapo" too);
#   3. verl end to end: a tiny model, a few steps, trainer_mode=entropylens, CE-GPPO + ERC, then
#      `entropylens report` on its output (examples/gpu_check_verl.sh, in verl's own venv: verl pins its
#      own transformers, so it cannot share the project's venv; VERL_VENV=/path/to/venv with verl 0.9.1,
#      vLLM and entropylens installed, or the active venv if it has them).
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "gpu_check: no NVIDIA GPU"; exit 1; }
status=0
echo "== 1. record_update does not synchronise (CUDA tests)"
timeout 120 python -m pytest -q -p no:cacheprovider -k "cuda" tests/record/test_recorder.py tests/rl/test_stats.py \
  tests/rl/test_head_stats.py || status=1
echo "== 2. TRL fused-head step, recorded against TRL's own"
timeout 240 python examples/gpu_trl_step.py --steps 8 || status=1
echo "== 3. verl end to end (trainer_mode=entropylens, CE-GPPO + ERC) and the report"
verl_path="$PATH"
[ -n "${VERL_VENV:-}" ] && verl_path="$VERL_VENV/bin:$PATH"
if ! PATH="$verl_path" python -c "import verl, vllm, entropylens" 2>/dev/null; then
  echo "gpu_check: no verl + vLLM + entropylens in ${VERL_VENV:-the active venv}: set VERL_VENV to a venv with them"
  status=1
elif [ -f examples/gpu_check_verl.sh ]; then
  PATH="$verl_path" timeout 240 bash examples/gpu_check_verl.sh || status=1
else
  echo "examples/gpu_check_verl.sh missing"; status=1
fi
exit $status
