"""TRL's GRPOTrainer with entropylens, offline on CPU: a tiny Qwen2 built from a config, a word-level
tokenizer built locally, a dataset from a dict, a Python reward.

    python examples/trl_grpo.py --out runs                 # TRL's own loss, recorded
    python examples/trl_grpo.py --out runs --loss ce_gppo  # CE-GPPO (beta 0.5 / 1) + ERC, from entropylens
    python examples/trl_grpo.py --out runs --attribution   # + the entropy attribution (entropy_effect)
"""

import argparse

WORDS = [str(d) for d in range(10)] + list("abcdefghij") + ["copy", ":"]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model(tokenizer, seed=0, hidden=32):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def digit_reward(completions, **kwargs):
    """Share of completion words that are digits: verifiable, learnable in a few steps."""
    return [sum(w.isdigit() for w in c.split()) / max(1, len(c.split())) for c in completions]


def make_trainer(
    out, loss=None, steps=3, seed=0, run=None, hidden=32, attribution=False, model=None, erc=(0.95, 1.05), **options
):
    """``options``: more GRPOConfig fields (e.g. beta=0.04, top_entropy_quantile=0.2); ``model``: a model
    or a saved model's directory (TRL builds a KL reference model from a directory only)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    tok = build_tokenizer()
    prompts = [f"copy : {' '.join(WORDS[(i * 3 + j) % 20] for j in range(4))}" for i in range(16)]
    base = dict(
        output_dir=f"{out}/.trl",
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_completion_length=8,
        learning_rate=5e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=seed,
        save_strategy="no",
        temperature=1.0,
        epsilon=0.2,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args = GRPOConfig(**{**base, **options})
    extra = dict(loss=loss, beta1=0.5, beta2=1.0, erc=erc) if loss else {}
    model = build_model(tok, seed, hidden) if model is None else model
    return EntropyLensGRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        entropylens_root=out,
        run=run,
        attribution=attribution,
        **extra,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", default="entropylens-runs")
    ap.add_argument("--loss", default=None, help="an entropylens loss (ce_gppo, gppo, dapo, ...); default TRL's")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--run", default=None)
    ap.add_argument(
        "--attribution",
        action="store_true",
        help="record the entropy attribution (entropy_effect; every pass through entropylens' head)",
    )
    a = ap.parse_args(argv)
    trainer = make_trainer(a.out, a.loss, a.steps, run=a.run, attribution=a.attribution)
    trainer.train()
    print(f"run: {trainer.recorder.dir}")
    return trainer


if __name__ == "__main__":
    main()
