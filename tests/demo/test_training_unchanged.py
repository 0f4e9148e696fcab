"""Recording never changes training: the numbers a loss trains with are the same bits with the
recorder on and off (the recorder only adds outputs to the passes, never a different summation)."""

import pytest
import torch

from entropylens import Recorder
from entropylens.demo.toy import config_for
from entropylens.demo.toy.train import ToyTrainer
from entropylens.rl import stats


def _logits(seed: int, with_neg_inf: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 7, 50, generator=g) * 3
    if with_neg_inf:
        z[:, :, [0, 17]] = float("-inf")  # vocabulary padding
    return z


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("with_neg_inf", [False, True])
def test_training_pass_is_the_same_bits_with_the_sensitivity(temperature, entropy_grad, with_neg_inf):
    """The training pass with the sensitivity and the one-hot distance (what the recorder asks for) gives
    the same log-probs, entropies and logit gradient as the pass without them, bit for bit (split sums
    such as S = S_rest + e_a would round differently: log p by ~1e-6, the toy's weights by a few ulps
    after one step)."""
    tok = torch.randint(1, 17, (3, 7), generator=torch.Generator().manual_seed(1))
    g_lp = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    g_h = torch.randn(3, 7, generator=torch.Generator().manual_seed(3))
    results = []
    for extra in (False, True):
        z = _logits(0, with_neg_inf).requires_grad_(True)
        out = stats.logprobs_and_entropy(
            z,
            tok,
            temperature=temperature,
            chunk_size=4,
            entropy_grad=entropy_grad,
            sensitivity=extra,
            one_hot_distance=extra,
        )
        lp, h = out[0], out[1]
        loss = (lp * g_lp).sum() + ((h * g_h).sum() if entropy_grad else 0.0)
        loss.backward()
        results.append((lp.detach(), h.detach(), z.grad))
    (lp0, h0, grad0), (lp1, h1, grad1) = results
    assert torch.equal(lp0, lp1) and torch.equal(h0, h1)
    assert torch.equal(grad0, grad1)


def test_head_pass_is_the_same_bits_with_the_sensitivity():
    g = torch.Generator().manual_seed(4)
    head = torch.randn(40, 8, generator=g)
    tok = torch.randint(0, 40, (2, 5), generator=g)
    results = []
    for extra in (False, True):
        hidden = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
        out = stats.head_stats(hidden, head, tok, temperature=0.8, chunk_size=3, sensitivity=extra)
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        results.append((out[0].detach(), out[1].detach(), hidden.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "method,kw",
    [
        ("grpo", {}),
        ("ce_gppo", {"beta1": 0.5, "beta2": 1.0, "erc": (0.95, 1.05)}),
        ("dapo", {"entropy_coef": 0.01}),  # the entropy bonus: the logits' gradient hook path
    ],
)
def test_toy_steps_train_the_same_weights_with_and_without_the_recorder(tmp_path, method, kw):
    """Two toy steps (rollout, old-policy pass, 4 recorded updates each) from the same state, once with the
    recorder off and once on: the weights after them are equal, bit for bit."""
    cfg = config_for(method, steps=2, prompts=4, group=4, minibatches=2, epochs=2, sft_steps=3, **kw)
    trainer = ToyTrainer(cfg)
    with torch.no_grad():
        for p in trainer.model.parameters():  # away from the warm start's exact values
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.01)
    start = trainer.state()
    weights = []
    for record in (False, True):
        trainer.load_state(start)
        rec = Recorder(tmp_path, run=f"{method}-{record}", config={"method": method}) if record else None
        for step in range(2):
            trainer.rl_step(step, rec)
        if rec:
            rec.close()
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_trl_trainer_trains_the_same_weights_as_plain_trl(tmp_path):
    """EntropyLensGRPOTrainer (recording on TRL's own fused LM head) and TRL's plain GRPOTrainer, same seed,
    gradient accumulation 2, num_iterations 2: the same weights after 2 steps, bit for bit.
    (attribution=True computes the log-probs with entropylens.rl.stats.head_stats instead of TRL's fused head:
    the same values to float32 rounding, ~1e-6 in the weights here, not the same bits; docs/trl.md says so.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
    import trl_tiny  # noqa: E402
    from datasets import Dataset
    from trl import GRPOTrainer

    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    weights = []
    for cls in (GRPOTrainer, EntropyLensGRPOTrainer):
        tok = trl_tiny.trl_grpo.build_tokenizer()
        kw = dict(entropylens_root=str(tmp_path), run="el") if cls is EntropyLensGRPOTrainer else {}
        trainer = cls(
            model=trl_tiny.trl_grpo.build_model(tok, 0),
            reward_funcs=trl_tiny.trl_grpo.digit_reward,
            args=trl_tiny.config(tmp_path / cls.__name__, num_iterations=2),
            train_dataset=Dataset.from_dict({"prompt": trl_tiny.prompts()}),
            processing_class=tok,
            **kw,
        )
        trainer.train()
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    assert (tmp_path / "el" / "run.json").exists()
    assert all(torch.equal(a, b) for a, b in zip(*weights))
