"""The per-token passes of the TRL trainer, with no TRL import: the batch keys of a multimodal model, sum
p^2 from what TRL's fused head captured, and the fallback through the backbone's hidden states and
:func:`entropylens.rl.stats.head_stats` (``attribution=True``, or a model without TRL's fused head)."""

from __future__ import annotations

from typing import cast

import torch

from ..rl.stats import head_stats

MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def captured_sum_sq(captures: list | None, k: int, shape) -> torch.Tensor | None:
    """sum_j p_j^2 [b, K] from the ``log_sum_sq_probs`` each fused forward of a pass captured; None where a
    forward gave none (the no-grad passes ask for none) or the pieces do not make the pass's shape."""
    if not captures or not all(c is not None for c in captures):
        return None
    sq = torch.cat([c[:, -k:] for c in captures]).float().exp()  # sum_j p_j^2 [b, K]
    return sq if sq.shape == shape else None


def head_stats_pass(
    base,
    autocast,
    input_ids,
    attention_mask,
    k: int,
    batch_size,
    *,
    compute_aux_loss: bool,
    temperature: float,
    sensitivity: bool,
):
    """The backbone's last hidden states of ``base`` (the causal LM) through head_stats, ``batch_size``
    sequences at a time (under ``autocast()``): (logps, entropies, sum p^2, s_t or None, aux) for the last
    ``k`` tokens. s_t where ``sensitivity``; aux (the router aux loss) where ``compute_aux_loss``."""
    backbone = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings()
    batch_size = batch_size or input_ids.size(0)
    lps, hs, sqs, sens, auxes = [], [], [], [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids = input_ids[s : s + batch_size]
        kw = {"output_router_logits": True} if compute_aux_loss else {}
        with autocast():
            out = backbone(input_ids=ids, attention_mask=attention_mask[s : s + batch_size], use_cache=False, **kw)
        hidden = out.last_hidden_state[:, -k - 1 : -1]  # [b, K, H]: predicts the K completion tokens
        lp, h, sq, *s_t = head_stats(
            hidden, head.weight, ids[:, -k:], bias=head.bias, temperature=temperature, sensitivity=sensitivity
        )
        sens += s_t
        lps.append(lp)
        hs.append(h)
        sqs.append(sq)
        if compute_aux_loss:
            auxes.append(getattr(out, "aux_loss", None))
    # the model returns aux_loss for every chunk once it returns it for the first
    aux = (
        torch.stack(cast("list[torch.Tensor]", auxes)).mean()
        if compute_aux_loss and auxes and auxes[0] is not None
        else None
    )
    return torch.cat(lps), torch.cat(hs), torch.cat(sqs), (torch.cat(sens) if sens else None), aux
