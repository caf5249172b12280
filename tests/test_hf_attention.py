"""Engram's GQA-aware attention for transformers (engram/integrations/hf_attention.py) and the cache layer with room
(engram/integrations/hf_cache.py), on the CPU: the attention equals softmax attention written out (KV heads
expanded, lower-right causal mask), its mask function leaves out the mask only where that is what it means, and
tiny random-weight models switched to it give transformers' own sdpa logits and greedy tokens."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

from helpers import missing

if importlib.util.find_spec("transformers") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("transformers", "the transformers integration needs it (pip install -e '.[dev]')")

from engram.integrations.hf_attention import (
    NAME,
    attention,
    lower_right_causal_mask,
    lower_right_causal_sdpa,
    use_gqa_attention,
)
from engram.integrations.hf_cache import RoomyLayer
from engram.replay.hf import cache_kwarg


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with the queries the last positions of the keys, every head's KV expanded: (B, q, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2)


class Causal(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(("queries", "keys"), [(5, 37), (1, 37), (37, 37)])
def test_attention_without_a_mask_is_lower_right_causal_over_the_kv_heads_as_stored(queries: int, keys: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, queries, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, keys, 16, generator=g, dtype=torch.float64) for _ in range(2))
    got, weights = attention(Causal(), q, k, v, None)
    assert weights is None and got.shape == (1, queries, 8, 16)
    assert torch.allclose(got, written_out(q, k, v), atol=1e-12)


def test_gradients_flow_through_the_lower_right_attention_as_through_the_written_out_one() -> None:
    """A forward of a few tokens against a cache with gradients on (a prompt tuned against a cached prefix, a
    probe's saliency): the lower-right attention is an operator of its own since session 53, registered with no
    autograd formula, and its backward raised "no autograd formula was registered" where the SDPA it replaced
    had one (a review, session 53). Its gradients are the written-out attention's."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 37, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    want = written_out(q * (0.3 * math.sqrt(16)), k, v)
    seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
    expected = torch.autograd.grad((want * seed).sum(), (q, k, v))
    eager, _ = attention(Causal(), q, k, v, None, scaling=0.3)  # SDPA's own backward
    operator = lower_right_causal_sdpa(q, k, v, 0.3)  # what a compiled forward calls: its registered backward
    for got in (eager, operator):
        grads = torch.autograd.grad((got * seed).sum(), (q, k, v))
        for have, exp in zip(grads, expected, strict=True):
            assert torch.allclose(have, exp, atol=1e-10)


def test_attention_given_a_mask_is_transformers_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = (torch.randn(1, 2, 12, 16, generator=g) for _ in range(2))
    mask = torch.ones(1, 1, 5, 12, dtype=torch.bool)
    mask[..., :3] = False  # padding: the first three keys are no one's
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = Causal()
    module.num_key_value_groups = 2  # type: ignore[assignment]
    got, _ = attention(module, q, k, v, mask)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(got, want)


def test_the_mask_function_leaves_out_only_a_plain_causal_mask_whose_queries_end_with_the_keys() -> None:
    from transformers.masking_utils import sliding_window_causal_mask_function

    plain = dict(batch_size=1, q_length=5, kv_length=37, q_offset=32, kv_offset=0)
    assert lower_right_causal_mask(**plain) is None
    assert lower_right_causal_mask(**plain, attention_mask=torch.ones(1, 37, dtype=torch.bool)) is None
    padded = torch.ones(1, 37, dtype=torch.bool)
    padded[0, 0] = False
    mask = lower_right_causal_mask(**plain, attention_mask=padded)
    assert mask is not None and not bool(mask[0, 0, :, 0].any()) and bool(mask[0, 0, -1, 1:].all())
    window = lower_right_causal_mask(**plain, mask_function=sliding_window_causal_mask_function(8), local_size=8)
    assert window is not None and int(window[0, 0, -1].sum()) == 8
    # An empty static cache's prefill: queries at the start of longer keys, whose tail is padding. transformers'
    # sdpa gives no mask there (upper-left causal, its keys cut to the queries); here that would read lower-right.
    future = torch.zeros(1, 37, dtype=torch.bool)
    future[0, :5] = True
    static = lower_right_causal_mask(batch_size=1, q_length=5, kv_length=37, q_offset=0, attention_mask=future)
    assert static is not None and bool(static[0, 0, 0, 0]) and not bool(static[0, 0, 0, 1:].any())
    assert lower_right_causal_mask(**plain, allow_is_causal_skip=False) is not None


def tiny(kind: str, attn: str) -> Any:
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    if kind == "llama":
        cfg, cls = tf.LlamaConfig(num_hidden_layers=2, **common), tf.LlamaForCausalLM
    else:
        cfg = tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
        cls = tf.Gemma3ForCausalLM
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).float().eval()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_model_switched_to_gqa_attention_gives_sdpas_logits_and_tokens_after_a_cache(kind: str) -> None:
    from transformers import DynamicCache

    stock, fast = tiny(kind, "sdpa"), tiny(kind, "sdpa")
    assert use_gqa_attention(fast) and fast.config._attn_implementation == NAME
    assert not use_gqa_attention(tiny(kind, "eager"))  # only sdpa is switched
    ids = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = stock(ids).logits[0, -1]
        cache = DynamicCache(config=fast.config)
        fast(ids[:, :60], **{cache_kwarg(fast): cache})
        got = fast(ids[:, 60:], **{cache_kwarg(fast): cache}).logits[0, -1]  # 15 queries against 75 keys
    assert float((got - want).norm() / want.norm()) <= 1e-5
    assert (fast.generate(ids, max_new_tokens=6, do_sample=False).tolist()
            == stock.generate(ids, max_new_tokens=6, do_sample=False).tolist())


def test_a_roomy_layer_appends_in_its_room_grows_it_when_full_and_concatenates_once_cropped() -> None:
    g = torch.Generator().manual_seed(3)
    room_k, room_v = torch.zeros(1, 2, 12, 4), torch.zeros(1, 2, 12, 4)
    first_k, first_v = torch.randn(1, 2, 7, 4, generator=g), torch.randn(1, 2, 7, 4, generator=g)
    room_k[:, :, :7], room_v[:, :, :7] = first_k, first_v
    layer = RoomyLayer(room_k, room_v, 7)
    new_k, new_v = torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)
    k, v = layer.update(new_k, new_v)
    assert layer.in_room and k.data_ptr() == room_k.data_ptr() and layer.get_seq_length() == 11
    assert torch.equal(k, torch.cat([first_k, new_k], dim=-2)) and torch.equal(room_v[:, :, 7:11], new_v)
    more_k, more_v = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    k, v = layer.update(more_k, more_v)  # 14 > 12: out of room, moved to larger buffers (256 tokens more)
    assert layer.in_room and layer.capacity == 14 + 256 and k.data_ptr() == layer.room_keys.data_ptr()
    assert torch.equal(k, torch.cat([first_k, new_k, more_k], dim=-2))
    assert torch.equal(v, torch.cat([first_v, new_v, more_v], dim=-2))
    cropped = RoomyLayer(room_k, room_v, 11)
    cropped.crop(-4)  # transformers replaced its tensors: the room's tail is no longer what the layer holds
    k, _ = cropped.update(more_k, more_v)
    assert not cropped.in_room and torch.equal(k, torch.cat([first_k, more_k], dim=-2))
    with pytest.raises(ValueError, match="cannot hold 13 tokens"):
        RoomyLayer(room_k, room_v, 13)


def test_what_no_flash_kernel_takes_goes_to_transformers_sdpa_with_the_lower_right_mask() -> None:
    """A head dim over 256, or 32-bit floats on a GPU (meta tensors stand in: none here): no fused kernel takes
    GQA; transformers' sdpa (KV heads expanded, the memory-efficient kernel) is given the mask it would have made."""
    from engram.integrations.hf_attention import _flash_takes

    def like(dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
        return torch.empty(1, 2, 9, dim, dtype=dtype, device=device)

    assert _flash_takes(like(128, torch.bfloat16, "meta"), like(128, torch.bfloat16, "meta"),
                        like(128, torch.bfloat16, "meta"))
    assert not _flash_takes(like(128, torch.float32, "meta"), like(128, torch.float32, "meta"),
                            like(128, torch.float32, "meta"))
    assert not _flash_takes(*(like(320, torch.float32, "cpu"),) * 3)
    assert not _flash_takes(like(128, torch.float32, "cpu"), like(128, torch.float32, "cpu"),
                            like(64, torch.float32, "cpu"))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 3, 320, generator=g, dtype=torch.float64)  # over 256: no fused kernel takes GQA
    k, v = (torch.randn(1, 2, 9, 320, generator=g, dtype=torch.float64) for _ in range(2))
    module = Causal()
    module.num_key_value_groups = 2  # type: ignore[assignment]
    got, _ = attention(module, q, k, v, None)
    assert torch.allclose(got, written_out(q, k, v), atol=1e-12)


def test_a_cache_loaded_under_inference_mode_takes_a_forward_outside_it() -> None:
    """`with torch.inference_mode(): past = cache.load(ids)`, then a generate (under no_grad): a room made of
    inference tensors takes no write outside inference mode; the layer moves to ordinary buffers first (a review,
    session 51: RuntimeError "Inplace update to inference tensor outside InferenceMode")."""
    with torch.inference_mode():
        room_k, room_v = torch.zeros(1, 2, 12, 4), torch.zeros(1, 2, 12, 4)
        layer = RoomyLayer(room_k, room_v, 7)
    new_k, new_v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with torch.no_grad():
        k, _ = layer.update(new_k, new_v)
    assert layer.in_room and k.shape[-2] == 10 and torch.equal(k[:, :, 7:], new_k)
    assert not layer.room_keys.is_inference()


def test_a_switched_model_compiles_with_fullgraph_after_a_cache() -> None:
    """torch.compile(fullgraph=True) of a suffix forward: traced, the mask function cannot read the padding mask
    and leaves the mask to transformers, as its own sdpa does (a review, session 51: dynamo failed on the read)."""
    import torch._dynamo
    from transformers import DynamicCache

    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    stock, fast = tiny("llama", "sdpa"), tiny("llama", "sdpa")
    assert use_gqa_attention(fast)
    got = []
    for model in (stock, fast):
        torch._dynamo.reset()
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[:, :30], **{cache_kwarg(model): cache})
            step = torch.compile(model, fullgraph=True, backend="eager")
            got.append(step(ids[:, 30:], attention_mask=torch.ones(1, 40, dtype=torch.long),
                            **{cache_kwarg(model): cache}).logits)
    assert torch.allclose(got[1], got[0], atol=1e-5)


def test_switching_a_multimodal_model_leaves_a_part_that_does_not_run_sdpa() -> None:
    """Its text model on sdpa, its vision tower set to eager: only the text model is switched (a review, session
    51: set_attn_implementation(NAME) switched every part)."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, num_hidden_layers=2)
    text = tf.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "full_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    model = tf.Gemma3ForConditionalGeneration._from_config(
        tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4),
        attn_implementation={"text_config": "sdpa", "vision_config": "eager", "": "sdpa"})
    assert use_gqa_attention(model) and model.config.text_config._attn_implementation == NAME
    assert model.config.vision_config._attn_implementation == "eager"


def test_a_compiled_suffix_forward_attends_through_the_lower_right_op_with_no_mask_and_no_kv_head_copies() -> None:
    """torch.compile of a switched model's suffix forward with no padding mask (what a hit's forward is): every layer's
    graph calls `engram::lower_right_causal_sdpa` on the KV heads as stored, builds no mask and expands no KV heads,
    and the logits equal the eager forward's. Before, traced, the mask function handed every layer transformers'
    mask, and transformers' sdpa copied the KV heads for it (`repeat_kv`)."""
    import torch._dynamo
    from transformers import DynamicCache

    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    model = tiny("llama", "sdpa")
    assert use_gqa_attention(model)
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        for cache in caches:
            model(ids[:, :30], **{cache_kwarg(model): cache})
        want = model(ids[:, 30:], **{cache_kwarg(model): caches[0]}).logits
        got = torch.compile(model, fullgraph=True, backend=keep)(ids[:, 30:], **{cache_kwarg(model): caches[1]}).logits
    assert torch.allclose(got, want, atol=1e-5)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    ours = [n for n in calls if "lower_right_causal_sdpa" in str(n.target)]
    assert len(ours) == model.config.num_hidden_layers
    assert not [n for n in calls if "scaled_dot_product_attention" in str(n.target)]  # transformers' sdpa: none
    assert not [n for n in calls if str(n.target).endswith("expand") or "repeat_interleave" in str(n.target)]
