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
            and (attention_mask is None or (not torch.compiler.is_compiling()
                                            and attention_mask.shape[-1] >= kv_offset + kv_length and bool(
                                                attention_mask[:, kv_offset: kv_offset + kv_length].all())))):
        return None  # (traced, a padding mask cannot be read: transformers' mask, as its own sdpa does)
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
    if not _flash_takes(query, key, value):  # transformers' sdpa, given the mask it would have made
        mask = (torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
                if causal and q_len < kv_len else None)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if causal and q_len < kv_len:  # (eager, SDPA's own kernels and their fused backward)
        return (lower_right_causal_sdpa if torch.compiler.is_compiling() else _lower_right)(query, key, value,
                                                                                             scaling), None
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@torch.library.custom_op("engram::lower_right_causal_sdpa", mutates_args=())
def lower_right_causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """SDPA of fewer queries than keys, causal aligned lower-right, over the KV heads as they are; out (B, q, Hq, D)
    contiguous, as transformers' attention returns it. An operator of its own so that torch.compile takes it whole:
    traced, the lower-right bias (a tensor subclass) is a graph break in every layer, and the kernel launches of a
    forward of a few tokens are what compiling it saves."""
    return _lower_right(query, key, value, scale)


def _lower_right(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    from torch.nn.attention.bias import causal_lower_right

    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(query.shape[2], key.shape[2]),
                                         scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


@lower_right_causal_sdpa.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    b, heads, q, _ = query.shape
    return query.new_empty((b, q, heads, value.shape[-1]))


def _setup_backward(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    query, key, value, scale = inputs
    ctx.save_for_backward(query, key, value)
    ctx.scale = scale


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
    """The attention's gradients, written out (in float32 at least), for a compiled forward against a cache with
    gradients on (a prompt tuned against a cached prefix failed its backward without: a review, session 53); eager,
    `attention` runs SDPA itself, with its fused backward. Its probabilities are (B, Hq, q, kv): a suffix's few
    queries."""
    query, key, value = ctx.saved_tensors
    work = torch.promote_types(query.dtype, torch.float32)
    q, k, v = (t.to(work) for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    probs = torch.softmax((q @ ke.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf")), dim=-1)
    d_out = grad.transpose(1, 2).to(work)  # (B, Hq, q, Dv)
    d_probs = d_out @ ve.transpose(-1, -2)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
    d_q = d_scores @ ke
    d_k = (d_scores.transpose(-1, -2) @ q).unflatten(1, (k.shape[1], group)).sum(2)
    d_v = (probs.transpose(-1, -2) @ d_out).unflatten(1, (v.shape[1], group)).sum(2)
    return d_q.to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None


lower_right_causal_sdpa.register_autograd(_backward, setup_context=_setup_backward)


def _flash_takes(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether SDPA's flash kernel takes these with enable_gqa (on the CPU, its own kernels do): a head dim of at
    most 256, the same for keys and values, and on a GPU 16-bit floats. Otherwise no fused kernel takes GQA and
    SDPA would run its math kernel over a materialized mask, where transformers' sdpa expands the KV heads and
    runs the memory-efficient one."""
    if not key.shape[-1] == value.shape[-1] <= 256:
        return False
    return query.device.type == "cpu" or query.dtype in (torch.float16, torch.bfloat16)


def register() -> None:
    """`engram_sdpa` known to transformers (its attention and its mask function); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, lower_right_causal_mask)


def use_gqa_attention(model: Any) -> bool:
    """Switch a model's parts running transformers' "sdpa" attention to `engram_sdpa` (the same attention, less
    copying: see the module's docstring); True if its text model runs it now. Parts on another implementation
    (eager, flash, flex: a multimodal model's vision tower set to eager) are left as they are.
    `model.set_attn_implementation("sdpa")` switches back."""
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    if getattr(text, "_attn_implementation", None) == NAME:
        return True
    targets = {key: NAME for key in getattr(cfg, "sub_configs", {}) or {}
               if getattr(getattr(cfg, key, None), "_attn_implementation", None) == "sdpa"}
    if getattr(cfg, "_attn_implementation", None) == "sdpa":
        targets[""] = NAME
    if not targets:
        return False
    register()
    model.set_attn_implementation(targets if set(targets) != {""} else NAME)
    log.info("%s: attention switched from sdpa to %s (GQA-aware, no mask for a plain causal forward): %s",
             type(model).__name__, NAME, ", ".join(k or "the model" for k in targets))
    return getattr(text, "_attn_implementation", None) == NAME
