"""``nn.MultiheadAttention`` inside an engine step: plain matmuls, its dropout keyed per client.

PyTorch's attention draws its dropout mask inside ``F.scaled_dot_product_attention`` (or
``F.dropout`` on the attention weights) from the one global generator, which ``vmap`` cannot key
per client, so a ``nn.TransformerEncoderLayer`` used to fall to the per-client loop. While the
engine runs a training step (stacked or on the loop alike), :func:`keyed_attention` computes the
same attention as ``F.multi_head_attention_forward`` (Vaswani et al., 2017, eq. 1; the in- and
out-projections of ``nn.MultiheadAttention``) with explicit ``matmul``/``softmax`` and draws the
dropout mask on the attention weights from the client's step key, as ``nn.Dropout`` layers do
(:mod:`.step_context`). Both paths run this code, so they agree; outside a step (evaluation,
the user's own calls) the layer is PyTorch's own.

Not covered (the layer then raises :class:`~.step_context.NotVectorizable` naming itself when
its dropout is active in a stacked step): ``add_bias_kv`` and ``add_zero_attn``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["attention_forward", "keyed_attention", "unsupported_attention"]


def unsupported_attention(layer: nn.MultiheadAttention) -> str | None:
    """What :func:`keyed_attention` does not compute for ``layer`` (None: it computes all of it)."""
    if layer.bias_k is not None or layer.bias_v is not None:
        return "add_bias_kv=True"
    if layer.add_zero_attn:
        return "add_zero_attn=True"
    return None


def _mask(
    layer: nn.MultiheadAttention,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    device: torch.device,
    n: int,
    l_: int,
    s: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """The additive mask [N*H, L, S] (or broadcastable), float, or None."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=dtype,
    )
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(l_, s, dtype=torch.bool, device=device).triu(1)
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=dtype,
        check_other=False,
    )
    h = layer.num_heads
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)  # [1, L, S]
    if key_padding_mask is not None:
        pad = key_padding_mask.view(n, 1, 1, s).expand(-1, h, -1, -1).reshape(n * h, 1, s)
        attn_mask = pad if attn_mask is None else attn_mask + pad
    return attn_mask


def keyed_attention(
    layer: nn.MultiheadAttention,
    dropout: Callable[[Tensor, float], Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``layer(query, key, value, ...)`` with the attention dropout drawn by ``dropout(weights, p)``.

    Args:
        layer: The attention layer (its projections and options).
        dropout: The step's keyed dropout (:meth:`.step_context.StepContext.dropout`).
        query: [L, N, E] ([N, L, E] with ``batch_first``), or unbatched [L, E].
        key: As ``query`` with S for L.
        value: As ``key``.
        key_padding_mask: [N, S] (bool: True is ignored; float: added).
        need_weights: Also return the attention weights.
        attn_mask: [L, S] or [N*H, L, S] (bool: True is not allowed; float: added).
        average_attn_weights: Average the returned weights over the heads.
        is_causal: A causal mask where ``attn_mask`` is None.
    """
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif layer.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    l_, n, e = query.shape
    s = key.shape[0]
    h = layer.num_heads
    d = e // h
    b = layer.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
    if layer._qkv_same_embed_dim:
        wq, wk, wv = layer.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight
    q = F.linear(query, wq, bq).reshape(l_, n * h, d).transpose(0, 1)
    k = F.linear(key, wk, bk).reshape(s, n * h, d).transpose(0, 1)
    v = F.linear(value, wv, bv).reshape(s, n * h, d).transpose(0, 1)
    scores = torch.matmul(q * math.sqrt(1.0 / d), k.transpose(-2, -1))  # [N*H, L, S]
    mask = _mask(layer, attn_mask, key_padding_mask, is_causal, query.device, n, l_, s, scores.dtype)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    dropped = dropout(weights, layer.dropout) if layer.training and layer.dropout > 0 else weights
    out = torch.matmul(dropped, v).transpose(0, 1).reshape(l_ * n, e)
    out = F.linear(out, layer.out_proj.weight, layer.out_proj.bias).view(l_, n, e)
    if unbatched:
        out = out.squeeze(1)
    elif layer.batch_first:
        out = out.transpose(0, 1)
    if not need_weights:
        return out, None
    w = weights.view(n, h, l_, s)
    w = w.mean(1) if average_attn_weights else w
    return out, w.squeeze(0) if unbatched else w


def attention_forward(
    layer: nn.MultiheadAttention,
    in_step: Callable[[], bool],
    dropout: Callable[[Tensor, float], Tensor],
    refuse: Callable[[], None],
) -> Callable[..., Any]:
    """``layer``'s forward: :func:`keyed_attention` while ``in_step()``, else PyTorch's own.

    ``refuse`` is called (and raises) in a step the keyed form does not cover.
    """
    own = type(layer).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not in_step():
            return own(layer, *args, **kwargs)
        if unsupported_attention(layer) is not None:
            refuse()
            return own(layer, *args, **kwargs)
        return keyed_attention(layer, dropout, *args, **kwargs)

    return forward
