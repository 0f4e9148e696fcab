"""TRL's fused-head GRPO step on one CUDA GPU, with and without entropylens' recording: time and peak
memory ratios (examples/gpu_check.sh runs it; it needs a GPU).

  python examples/gpu_trl_step.py [--steps 8] [--hidden 512] [--vocab 151936]

Each trainer runs in turn in this process on the same saved model (Qwen2 from a config, a word-level
tokenizer padded to ``--vocab`` entries, no downloads), KL beta 0.04 and top_entropy_quantile 0.2 on:
TRL's GRPOTrainer, EntropyLensGRPOTrainer with TRL's loss, and with loss="dapo". Step times are means
over steps 2 .. n-1 (torch.cuda.synchronize at each step's end); peak memory is
torch.cuda.max_memory_allocated over the run, reset before each trainer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    import torch
    import trl_grpo
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    if not torch.cuda.is_available():
        raise SystemExit("gpu_trl_step: no CUDA device")

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    opts = dict(
        use_cpu=False,
        beta=0.04,
        top_entropy_quantile=0.2,
        bf16=True,
        max_completion_length=128,
        per_device_train_batch_size=8,
    )
    res = {}
    with tempfile.TemporaryDirectory() as d:
        saved = f"{d}/model"
        trl_grpo.build_model(trl_grpo.build_tokenizer(), 0, a.hidden).save_pretrained(saved)
        for mode in ("trl", "recorded", "el-dapo", "trl", "recorded", "el-dapo"):
            el = trl_grpo.make_trainer(
                f"{d}/{mode}{len(res)}",
                steps=a.steps,
                model=saved,
                erc=None,
                loss="dapo" if mode == "el-dapo" else None,
                **opts,
            )
            tr = el
            if mode == "trl":
                el.recorder.close()
                tr = GRPOTrainer(
                    model=saved,
                    reward_funcs=trl_grpo.digit_reward,
                    args=el.args,
                    train_dataset=el.train_dataset,
                    processing_class=el.processing_class,
                )
            timer = Timer()
            tr.add_callback(timer)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            tr.train()
            peak = torch.cuda.max_memory_allocated() / 2**30
            res.setdefault(mode, []).append((statistics.fmean(timer.times[2:]), peak))
            del tr, el
    mean = {m: (statistics.fmean(t for t, _ in v), max(p for _, p in v)) for m, v in res.items()}
    for m, (t, p) in mean.items():
        print(f"  {m:<9} step {t * 1000:8.1f} ms   peak {p:6.2f} GiB")
    for m in ("recorded", "el-dapo"):
        print(
            f"{m} / trl: step time {mean[m][0] / mean['trl'][0]:.3f}x, peak memory {mean[m][1] / mean['trl'][1]:.3f}x"
        )


if __name__ == "__main__":
    main()
