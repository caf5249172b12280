"""GQA-aware SDPA for a transformers model's forward of a few tokens against a long cache (the forward after a hit).

transformers' own "sdpa" attention, for any forward of several tokens against a cache (a prompt's suffix after a hit),
gets a materialized causal mask and, with a mask, expands the KV heads to the query heads (`repeat_kv`: a copy of the
whole cache per layer, 4x a Llama-3-8B's KV) and runs SDPA on a kernel that takes masks. On an H100, of the 67 ms a
32-token forward against a 32K-token cache took, 19 ms were that expansion (benchmarks/RESULTS.md ttft "Session 50").

`engram_sdpa` is transformers' sdpa but for one case: a causal mask with nothing else in it (no padding, no window,
no custom pattern) whose queries are the last positions of the keys. Its mask function (`lower_right_causal_mask`)
returns no mask for that case, and its attention runs SDPA with a lower-right causal bias and `enable_gqa`: flash
attention over the KV heads as stored, no copy. Every other case gets transformers' mask and attention unchanged.
`use_gqa_attention(model)` switches a model that runs "sdpa" to it (EngramPrefixCache does, unless told not to).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("engram.integrations")

NAME = "engram_sdpa"


def lower_right_causal_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                            mask_function: Any = None, attention_mask: Tensor | None = None,
                            local_size: int | None = None, allow_is_causal_skip: bool = True,
                            **kwargs: Any) -> Tensor | None:
    """No mask (None) for a plain causal mask whose queries end where the keys end, which `attention` reads as
    lower-right causal; otherwise transformers' sdpa mask, never None for several queries against more keys (its
    None there means upper-left causal: an empty static cache's prefill)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (allow_is_causal_skip and mask_function in (None, causal_mask_function) and local_size is None
            and q_offset + q_length == kv_offset + kv_length
            and (attention_mask is None or bool(attention_mask[:, kv_offset: kv_offset + kv_length].all()))):
        return None
    given = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                 kv_offset=kv_offset, attention_mask=attention_mask, local_size=local_size, **kwargs)
    if mask_function is not None:
        given["mask_function"] = mask_function
    mask = sdpa_mask(allow_is_causal_skip=allow_is_causal_skip, **given)
    if mask is None and 1 < q_length < kv_length:
        mask = sdpa_mask(allow_is_causal_skip=False, **given)
    return mask


def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
              **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: (B, Hq, q, D) queries against (B, Hkv, kv, D) keys and values, output (B,
    q, Hq, D). With no mask, causal attention aligned lower-right (the last query sees every key) over the KV heads as
    they are; anything else is transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is not None or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
    bias: Any = None
    if causal and q_len < kv_len:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(q_len, kv_len)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, is_causal=causal and bias is None,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """`engram_sdpa` known to transformers (its attention and its mask function); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, lower_right_causal_mask)


def use_gqa_attention(model: Any) -> bool:
    """Switch a model running transformers' "sdpa" attention to `engram_sdpa` (the same results, less copying:
    see the module's docstring); True if it runs it now. Other implementations (eager, flash, flex) are left."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    log.info("%s: attention switched from sdpa to %s (GQA-aware, no mask for a plain causal forward)",
             type(model).__name__, NAME)
    return getattr(model.config, "_attn_implementation", None) == NAME
