"""Offline inputs for a verl smoke run (no hub downloads): a tiny Qwen2 built from a config with a
word-level tokenizer (saved as a Hugging Face model directory), a copy-the-digits prompt set in verl's
RL parquet format, and its reward function.

    python examples/verl/make_tiny.py OUT    # -> OUT/model, OUT/train.parquet, OUT/test.parquet, OUT/reward.py
"""

import sys
from pathlib import Path

WORDS = [str(d) for d in range(10)] + list("abcdefghij") + ["copy", ":"]
CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}: {% endif %}"
REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of the response's words that are digits (learnable in a few steps)."""
    words = solution_str.split()
    return sum(w.isdigit() for w in words) / max(1, len(words))
'''


def main(out: str) -> None:
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out)
    (out_dir / "model").mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    hf_tok.chat_template = CHAT
    hf_tok.save_pretrained(out_dir / "model")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(hf_tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=hf_tok.pad_token_id,
        eos_token_id=hf_tok.eos_token_id,
        bos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out_dir / "model")
    rows = []
    for i in range(64):
        words = " ".join(WORDS[(i * 3 + j) % 20] for j in range(4))
        rows.append(
            {
                "data_source": "entropylens_copy",
                "prompt": [{"role": "user", "content": f"copy : {words}"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": words},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    pd.DataFrame(rows[:48]).to_parquet(out_dir / "train.parquet")
    pd.DataFrame(rows[48:]).to_parquet(out_dir / "test.parquet")
    (out_dir / "reward.py").write_text(REWARD)
    print(out_dir)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "verl-tiny")
