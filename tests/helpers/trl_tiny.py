"""A tiny offline TRL GRPO setup for the TRL tests: Qwen2 from a config, a local word-level tokenizer,
a dict dataset, a Python reward (examples/trl_grpo.py's pieces), with every knob the tests turn."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import trl_grpo  # noqa: E402

WORDS = trl_grpo.WORDS


def prompts(n=16):
    return [f"copy : {' '.join(WORDS[(i * 3 + j) % 20] for j in range(4))}" for i in range(n)]


def config(out, **kw):
    from trl import GRPOConfig

    base = dict(
        output_dir=f"{out}/.trl",
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=1,
        max_completion_length=8,
        learning_rate=5e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        temperature=1.0,
        epsilon=0.2,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    base.update(kw)
    return GRPOConfig(**base)


def trainer(out, run, *, cls=None, model=None, peft_config=None, el=None, **cfg):
    from datasets import Dataset

    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    tok = trl_grpo.build_tokenizer()
    cls = cls or EntropyLensGRPOTrainer
    return cls(
        model=model if model is not None else trl_grpo.build_model(tok, 0),
        reward_funcs=trl_grpo.digit_reward,
        args=config(out, **cfg),
        train_dataset=Dataset.from_dict({"prompt": prompts()}),
        processing_class=tok,
        entropylens_root=str(out),
        run=run,
        peft_config=peft_config,
        **(el or {}),
    )
