#!/usr/bin/env bash
# The verl part of examples/gpu_check.sh, as one function: gpu_check_verl WORKDIR (exit status 0 = passed).
#
# On a machine with one NVIDIA GPU and verl 0.9.1 + vLLM + entropylens installed (no downloads): a tiny
# Qwen2 built from a config (examples/verl/make_tiny.py), 2 steps of verl's v1 trainer with
# trainer.v1.trainer_mode=entropylens, CE-GPPO + ERC, per-token recording (FSDP engine, vLLM rollout),
# then checks and `entropylens report` on the recorded run. Time-bounded: the training job gets
# ${GPU_CHECK_VERL_TIMEOUT:-190} s, the whole function stays under 4 minutes.
#
# Checks: every response token of both steps recorded once, with the exact logit-gradient norm
# (sum pi^2 from the engine) and ERC's entropy ratio; the logged entropylens/<name> values (verl's file
# logger) are the steps' values computed over all their updates (n_tokens summed, clipped_frac
# token-weighted), no additive share (entropylens/_sum/...) reaches the logs; the report renders.
#
#   source examples/gpu_check_verl.sh && gpu_check_verl /tmp/verl-check
#   bash examples/gpu_check_verl.sh [WORKDIR]          # the same, standalone

GPU_CHECK_VERL_EXAMPLES="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$GPU_CHECK_VERL_EXAMPLES/verl/tiny_overrides.sh"

gpu_check_verl() {
  local work="${1:-$(mktemp -d)}"
  local runs="$work/runs"
  local limit="${GPU_CHECK_VERL_TIMEOUT:-190}"
  mkdir -p "$work"
  echo "== verl: tiny Qwen2, 2 steps, trainer_mode=entropylens, CE-GPPO + ERC -> $work"
  python "$GPU_CHECK_VERL_EXAMPLES/verl/make_tiny.py" "$work" >/dev/null || { echo "FAIL verl: make_tiny.py"; return 1; }
  verl_tiny_overrides "$work" "$runs" gpu-check-verl
  VERL_FILE_LOGGER_PATH="$work/metrics.jsonl" timeout -k 15 "$limit" python3 -m verl.trainer.main_ppo \
    "${VERL_TINY[@]}" trainer.save_freq=-1 trainer.total_training_steps=2 \
    trainer.logger='["console","file"]' trainer.experiment_name=gpu_check_verl \
    >"$work/train.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$work/train.log"
    # past the limit (124 / 137): the job's own local Ray cluster outlives its killed driver; stop it
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then ray stop --force >/dev/null 2>&1 || true; fi
    echo "FAIL verl: training exited $rc (124 / 137: stopped at the ${limit} s limit)"; return 1
  fi
  python - "$runs/gpu-check-verl" "$work/metrics.jsonl" <<'PY' || { echo "FAIL verl: recorded run / logged metrics"; return 1; }
import json, math, sys
from entropylens.read import query
run, log = sys.argv[1], sys.argv[2]
con = query.connect(run)
n, steps, lgn, rho, twice = con.execute(
    "select count(*), count(distinct step), count(logit_grad_norm), count(entropy_ratio), "
    "count(*) - count(distinct (step, update, rank, seq, pos)) from tokens").fetchone()
print(f"verl: rows={n} steps={steps} logit_grad_norm={lgn} entropy_ratio={rho} duplicates={twice}")
assert n > 0 and steps == 2 and twice == 0, "expected token rows of 2 steps, each once"
assert lgn == n and rho == n, "every row needs logit_grad_norm (sum pi^2) and entropy_ratio (ERC)"
assert con.execute("select count(erc_drop_frac) from steps").fetchone()[0] > 0, "ERC aggregates missing"
logged = {}
for line in open(log):
    rec = json.loads(line)
    logged[int(rec["step"])] = rec["data"]
for step in (1, 2):
    m = logged[step]
    assert not [k for k in m if k.startswith("entropylens/_sum/")], "additive shares reached the logs"
    tok, clipped = con.execute(f"select sum(n_tokens), sum(clipped_frac * n_tokens) from steps where step = {step}").fetchone()
    print(f"verl: step {step}: logged n_tokens={m['entropylens/n_tokens']} steps table={tok}; "
          f"clipped_frac logged={m['entropylens/clipped_frac']:.6f} steps table={clipped / tok:.6f}")
    assert m["entropylens/n_tokens"] == tok, "entropylens/n_tokens is not the step's total"
    assert math.isclose(m["entropylens/clipped_frac"], clipped / tok, rel_tol=1e-4, abs_tol=1e-6)
    assert "actor/pg_clipfrac_lower" in m and "entropylens/dual_clip_frac" in m
PY
  entropylens report "$runs/gpu-check-verl" --out "$work/report" >/dev/null || { echo "FAIL verl: entropylens report"; return 1; }
  test -s "$work/report/index.html" || { echo "FAIL verl: no report/index.html"; return 1; }
  echo "OK verl: $work/report/index.html"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  gpu_check_verl "$@"
fi
