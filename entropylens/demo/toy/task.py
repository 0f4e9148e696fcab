"""The toy task: "shifted lookup" with systematic confusions. Verifiable, cheap, ambiguous at start.

Vocabulary (32 tokens): 20 symbols (ids 0..19), SEP (20), BOS (21), 10 unused filler ids that the
policy can still emit (22..31), so full-vocabulary entropy is over 32 tokens. Their texts
(:data:`TOKEN_NAMES`): the symbols A..T, SEP '|', BOS '<s>', the fillers f22..f31.

Prompt: BOS x_0 .. x_7 SEP, with x_i uniform over the 20 symbols.
Response: 16 tokens. The correct token at position t is y_t = (x_{t mod 8} + 7 * (t div 8)) mod 20:
the first half copies the prompt, the second half copies it shifted by 7.
Reward: the fraction of the 16 positions that are correct (0 .. 1), checked by :func:`reward`.

Ambiguity: the policy starts from a short supervised warm-start on *noisy* targets. For every
symbol s a confuser c(s) = (s + 1) mod 20 stands in for the correct token with probability
``confuse`` (0.7 for odd targets, 0.2 for even ones), and a uniform random symbol with probability
``noise``. So the warm policy is uncertain everywhere (about 1 nat per token) and, for odd targets,
the correct token is often the *less* likely one: RL must raise low-probability correct tokens
(PA&LP) and push down high-probability wrong ones (NA&HP) — exactly the tokens PPO-clip tends to
clip. Exploration pays: a policy that collapses onto the confuser early stays wrong.
"""

from __future__ import annotations

import torch

N_SYMBOLS = 20
SEP, BOS = 20, 21
VOCAB = 32
PROMPT_LEN = 8
RESPONSE_LEN = 16
# each token id's text (what run.json's vocabulary and a token viewer show): symbols A..T, SEP '|', BOS '<s>',
# the fillers f22..f31
TOKEN_NAMES: tuple[str, ...] = (
    tuple(chr(ord("A") + s) for s in range(N_SYMBOLS)) + ("|", "<s>") + tuple(f"f{i}" for i in range(BOS + 1, VOCAB))
)


def decode(ids) -> str:
    """The text of token ids (a list or a 1-D tensor): their TOKEN_NAMES joined with spaces ('A B |')."""
    return " ".join(TOKEN_NAMES[int(i)] for i in ids)


def make_prompts(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, PROMPT_LEN + 2] int64: BOS x_0..x_7 SEP."""
    x = torch.randint(0, N_SYMBOLS, (n, PROMPT_LEN), generator=gen)
    bos = torch.full((n, 1), BOS)
    sep = torch.full((n, 1), SEP)
    return torch.cat([bos, x, sep], dim=1)


def targets(prompts: torch.Tensor) -> torch.Tensor:
    """[n, RESPONSE_LEN]: y_t = (x_{t mod 8} + 7 (t div 8)) mod 20."""
    x = prompts[:, 1 : 1 + PROMPT_LEN]
    t = torch.arange(RESPONSE_LEN)
    return (x[:, t % PROMPT_LEN] + 7 * (t // PROMPT_LEN)) % N_SYMBOLS


def reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """[n] float32 in [0, 1]: fraction of correct response positions."""
    return (responses == targets(prompts)).float().mean(dim=1)


def noisy_targets(
    prompts: torch.Tensor, gen: torch.Generator, confuse_odd: float = 0.7, confuse_even: float = 0.2, noise: float = 0.1
) -> torch.Tensor:
    """Warm-start labels: the correct token, its confuser (s + 1) mod 20, or a random symbol."""
    y = targets(prompts)
    u = torch.rand(y.shape, generator=gen)
    p_conf = torch.where(y % 2 == 1, confuse_odd, confuse_even)
    confused = (y + 1) % N_SYMBOLS
    rand = torch.randint(0, N_SYMBOLS, y.shape, generator=gen)
    out = torch.where(u < p_conf, confused, y)
    return torch.where((u >= p_conf) & (u < p_conf + noise), rand, out)
