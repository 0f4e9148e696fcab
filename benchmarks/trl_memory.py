"""Peak memory of one TRL GRPO training step, with and without entropylens (CPU, peak RSS).

  python benchmarks/trl_memory.py [--rounds 2] [--completion 192] [--generations 8] [--kl] [--top-entropy]
                                  [--loss dapo]

``--kl`` (beta 0.04: TRL builds a reference model from the saved model) and ``--top-entropy``
(top_entropy_quantile 0.2) turn TRL's options on for every child; ``--loss M`` adds a child that trains
with entropylens' loss M (recorded), against TRL's own loss at the same options.

Setup: a tiny Qwen2 (hidden 64, 2 layers) with Qwen's real vocabulary size V = 151936, a local
word-level tokenizer of that size, 8 completions x 192 tokens in one micro-batch (the full logits of
one pass would be 8 x (P + 192) x 151936 float32 = about 1 GB: they dominate everything else).

Method: each trainer runs in a FRESH subprocess (same script, same process type; only the trainer
class differs: TRL's GRPOTrainer vs EntropyLensGRPOTrainer with full recording and TRL's loss, and
with ``--attribution`` also EntropyLensGRPOTrainer(attribution=True): every pass through
entropylens' own tiled head, head_stats, with the entropy sensitivity in the training pass).
After the trainer is built, the child resets the kernel's peak-RSS mark (write 5 to
/proc/self/clear_refs), runs one optimizer step (generation, old-policy pass, forward, backward,
recording) and reads VmHWM from /proc/self/status: the process's true peak resident memory over
the step, every allocator included (torch's CPU allocator returns big blocks to the OS, so peak RSS
sees each [b, K, V] tensor; tracemalloc would not see torch's allocations at all).
Rounds alternate the two children. Printed: peak RSS of the step, RSS before it, and their ratios.
Last line: trl_memory_ratio=<entropylens peak / TRL peak> (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

V = 151936


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(mode: str, out: str, completion: int, generations: int, options: dict, loss: str | None) -> dict:
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    words = ["<pad>", "<eos>", "<unk>"] + [str(d) for d in range(10)] + ["copy", ":"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), V)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=completion + 32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    if options.get("beta"):  # TRL builds the KL reference model from a path
        model.save_pretrained(f"{out}/model")
        model = f"{out}/model"
    args = GRPOConfig(
        **options,
        output_dir=f"{out}/.trl",
        max_steps=1,
        per_device_train_batch_size=generations,
        num_generations=generations,
        gradient_accumulation_steps=1,
        max_completion_length=completion,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    def reward(completions, **kw):
        return [sum(w.isdigit() for w in c.split()) / max(1, len(c.split())) for c in completions]

    data = Dataset.from_dict({"prompt": ["copy : 1 2 3 4"] * 4})
    common = dict(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    if mode == "plain":
        trainer = GRPOTrainer(**common)
    else:
        from entropylens.integrations.trl import EntropyLensGRPOTrainer

        trainer = EntropyLensGRPOTrainer(
            **common,
            entropylens_root=out,
            run="mem",
            attribution=mode == "attribution",
            loss=loss if mode == "el-loss" else None,
        )
    before = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    trainer.train()
    peak = _rss_kb("VmHWM")
    lengths = (
        [int(x) for x in trainer._buffered_inputs[0]["completion_mask"].sum(1)] if trainer._buffered_inputs else []
    )
    return {"mode": mode, "before_mb": before / 1024, "peak_mb": peak / 1024, "completion_lengths": lengths}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--completion", type=int, default=192)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--attribution", action="store_true", help="also measure attribution=True (head_stats)")
    ap.add_argument("--kl", action="store_true", help="beta 0.04 for every child")
    ap.add_argument("--top-entropy", action="store_true", help="top_entropy_quantile 0.2 for every child")
    ap.add_argument("--loss", default=None, help="also measure entropylens' loss (e.g. dapo) replacing TRL's")
    ap.add_argument("--child", choices=["plain", "entropylens", "attribution", "el-loss"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    options = {**(dict(beta=0.04) if a.kl else {}), **(dict(top_entropy_quantile=0.2) if a.top_entropy else {})}
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.out, a.completion, a.generations, options, a.loss)))
        return
    res: dict[str, list[dict]] = {
        "plain": [],
        "entropylens": [],
        **({"attribution": []} if a.attribution else {}),
        **({"el-loss": []} if a.loss else {}),
    }
    flags = [
        *(["--kl"] if a.kl else []),
        *(["--top-entropy"] if a.top_entropy else []),
        *(["--loss", a.loss] if a.loss else []),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for mode in res:
                p = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        mode,
                        "--out",
                        f"{d}/{mode}{r}",
                        "--completion",
                        str(a.completion),
                        "--generations",
                        str(a.generations),
                        *flags,
                    ],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode != 0 or not line:
                    sys.exit(f"{mode} child failed:\n{p.stderr[-3000:]}")
                res[mode].append(json.loads(line[0][7:]))
    peak = {m: max(x["peak_mb"] for x in v) for m, v in res.items()}
    before = {m: min(x["before_mb"] for x in v) for m, v in res.items()}
    lens = res["plain"][0]["completion_lengths"]
    prompt_len = 5
    logits_mb = len(lens) * (prompt_len + a.completion) * V * 4 / 2**20
    print(
        f"One TRL GRPO step, tiny Qwen2 (hidden 64) with V = {V}, {a.generations} completions x "
        f"{a.completion} tokens (lengths {min(lens) if lens else '?'}-{max(lens) if lens else '?'}); "
        f"one pass's full float32 logits would be {logits_mb:.0f} MB. Peak RSS per fresh process, "
        f"max over {a.rounds} rounds:"
    )
    for m in res:
        print(
            f"  {m:<12} peak {peak[m]:8.0f} MB   before the step {before[m]:8.0f} MB   "
            f"step's own {peak[m] - before[m]:8.0f} MB"
        )
    step_ratio = (peak["entropylens"] - before["entropylens"]) / max(1e-9, peak["plain"] - before["plain"])
    print(f"step_memory_ratio={step_ratio:.3f}")
    if a.attribution:
        print(f"attribution_memory_ratio={peak['attribution'] / peak['plain']:.3f}")
    if a.loss:
        print(f"options {options or 'none'}: loss={a.loss} recorded against TRL's own loss unrecorded")
        print(f"trl_loss_memory_ratio={peak['el-loss'] / peak['plain']:.3f}")
    print(f"trl_memory_ratio={peak['entropylens'] / peak['plain']:.3f}")


if __name__ == "__main__":
    main()
