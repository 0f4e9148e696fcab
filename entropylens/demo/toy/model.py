"""A tiny Qwen2-style causal LM built from a transformers config: no download, seeded, CPU."""

from __future__ import annotations

import torch

from . import task


def build_model(hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
    """~90k parameters at the defaults (vocab 32, tied embeddings, 2 key/value heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=task.VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 5 // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=task.BOS,
        eos_token_id=task.SEP,
        pad_token_id=task.SEP,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.config.use_cache = True
    return model


def response_logits(model, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits that predict the response tokens: [n, T, V] for seqs [n, prompt_len + T]."""
    return model(input_ids=seqs).logits[:, prompt_len - 1 : -1]


def _cache_kw(model) -> str:
    """transformers 5.x names the KV cache argument `cache`; 4.x called it `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@torch.no_grad()
def sample(
    model, prompts: torch.Tensor, length: int, gen: torch.Generator, temperature: float = 1.0, transform=None
) -> torch.Tensor:
    """Autoregressive sampling with a KV cache at ``temperature``: [n, length] token ids. ``transform``:
    the sampler's own logits from the model's (sampler.sampler_logits: a mismatched sampler), or None."""
    kw = _cache_kw(model)
    out = model(input_ids=prompts, use_cache=True)
    past, logits = getattr(out, kw), out.logits[:, -1]
    toks = []
    for i in range(length):
        z = logits.float() if transform is None else transform(logits)
        probs = torch.softmax(z / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)  # [n, 1]
        toks.append(nxt)
        if i + 1 < length:
            out = model(input_ids=nxt, use_cache=True, **{kw: past})
            past, logits = getattr(out, kw), out.logits[:, -1]
    return torch.cat(toks, dim=1)
