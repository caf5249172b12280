"""Where a TTFT with Engram goes: the load, then the suffix's forward, which is the worker's own cost.

benchmarks/ttft.py times load + suffix forward as one figure. This splits it, on the same Llama-3-8B-shaped
random-weight model and a real `engram serve` subprocess (a DRAM pool): the load alone (`EngramPrefixCache.load`),
the suffix's forward against the loaded cache, the same forward against a cache the model built itself (so a
difference would be the integration's fault: the loaded cache's layout), and a forward of the suffix alone, with no
cache (the fixed cost of one transformers forward). Then a profile of the forward against the loaded cache, top
operators by GPU time: what the rest of a TTFT is spent on.

The worker's side in two forms: transformers' own (its sdpa attention over a DynamicCache, which expands the KV heads
and concatenates the cache on every forward) and what EngramPrefixCache runs now (engram/integrations: attention
over the KV heads as loaded, with no mask, and a cache with room for the suffix, appended in place); each half alone
too (GQA attention over a DynamicCache).

    python -m benchmarks.ttft_breakdown [--tokens 32768] [--suffix 32] [--codecs raw,nvfp4]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._harness import engram_daemon, machine
from benchmarks.ttft import build_model  # (also takes the repository root off sys.path)
from engram.client import SyncEngramClient
from engram.integrations.hf_attention import use_gqa_attention
from engram.integrations.hf_cache import RoomyLayer
from engram.integrations.transformers import EngramPrefixCache, cache_kwarg


def timed(f: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median and best of `rounds` calls in ms, after one warm-up, the GPU synchronized around each."""
    f()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out), min(out)


def with_kv(model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A fresh DynamicCache whose layers hold these (keys, values): the suffix's forward appends to a copy of
    the cache's list, never to the tensors given."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layer: Any
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def roomy(model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], room: int) -> Any:
    """A cache as EngramPrefixCache.load builds it, over these (keys, values) copied into buffers with `room`
    tokens after them: made once, then `fresh` views of it for each forward (which appends in place)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        n = k.shape[-2]
        buf = torch.empty(2, *k.shape[:-2], n + room, k.shape[-1], dtype=k.dtype, device=k.device)
        buf[0, :, :, :n], buf[1, :, :, :n] = k, v
        cache.layers[i] = RoomyLayer(buf[0], buf[1], n)
    return cache


def fresh(model: Any, cache: Any, length: int) -> Any:
    """A cache over the same room buffers holding their first `length` tokens again."""
    from transformers import DynamicCache

    out = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        out.layers[i] = RoomyLayer(layer.room_keys, layer.room_values, length)
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--codecs", default="raw,nvfp4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    dev = torch.device("cuda")
    model = build_model(False, dev)
    kw = cache_kwarg(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens + args.suffix), generator=g).to(dev)
    prefix, suffix = ids[:, : args.tokens], ids[:, args.tokens :]
    model(torch.zeros(1, 256, dtype=torch.long, device=dev))  # kernels compiled before anything is timed
    own = DynamicCache(config=model.config)
    model(prefix, **{kw: own})
    own_kv = [(layer.keys, layer.values) for layer in own.layers]
    print(f"ttft_breakdown, {datetime.date.today()}, {machine()}, {torch.cuda.get_device_name()}, "
          f"{args.tokens} cached tokens + {args.suffix}; ms median / best of {args.rounds}")
    print("| step | codec | ms (median / best) |\n|---|---|---:|")
    row = "| {} | {} | {:.1f} / {:.1f} |"
    print(row.format("prefill of the whole prompt", "-", *timed(lambda: model(ids).logits[0, -1].argmax().item(),
                                                             args.rounds)))
    print(row.format(f"forward of the {args.suffix} suffix tokens alone, no cache", "-",
                     *timed(lambda: model(suffix).logits[0, -1].argmax().item(), args.rounds)))
    print(row.format("suffix forward against the model's own cache (transformers: sdpa, DynamicCache)", "-", *timed(
        lambda: model(suffix, **{kw: with_kv(model, own_kv)}).logits[0, -1].argmax().item(), args.rounds)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(suffix, **{kw: with_kv(model, own_kv)}).logits[0, -1].argmax().item()
        torch.cuda.synchronize()
    stock_profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50)
    want = model(suffix, **{kw: with_kv(model, own_kv)}).logits[0, -1].float()
    whole_prompt = model(ids).logits[0, -1].float()  # transformers against itself: how far bf16 rounding alone moves
    print(f"(transformers' suffix forward against its own whole-prompt prefill: first-step logits relative L2 "
          f"difference {float((want - whole_prompt).norm() / whole_prompt.norm()):.2e}, same argmax: "
          f"{bool(want.argmax() == whole_prompt.argmax())})")
    use_gqa_attention(model)  # from here on the model attends as EngramPrefixCache has it
    print(row.format("the same, GQA attention (engram_sdpa), DynamicCache", "-", *timed(
        lambda: model(suffix, **{kw: with_kv(model, own_kv)}).logits[0, -1].argmax().item(), args.rounds)))
    own_room = roomy(model, own_kv, args.suffix)
    print(row.format("the same, GQA attention, cache with room (EngramPrefixCache's)", "-", *timed(
        lambda: model(suffix, **{kw: fresh(model, own_room, args.tokens)}).logits[0, -1].argmax().item(),
        args.rounds)))
    got = model(suffix, **{kw: fresh(model, own_room, args.tokens)}).logits[0, -1].float()
    print(f"(GQA attention with room against transformers' own: first-step logits relative L2 difference "
          f"{float((got - want).norm() / want.norm()):.2e}, same argmax: {bool(got.argmax() == want.argmax())})")
    profiled = ""
    for codec in args.codecs.split(","):
        with engram_daemon("unix", dram="12GiB") as address, \
                SyncEngramClient(address, namespace=f"breakdown-{codec}") as client:
            cache = EngramPrefixCache(model, client, codec=codec, weights_id="random-llama-3-8b-shaped")
            cache.store(prefix[0].tolist(), own)
            print(row.format("load (EngramPrefixCache.load)", codec, *timed(lambda c=cache: c.load(ids), args.rounds)))
            loaded = cache.load(ids)

            def forward(c: Any = loaded) -> None:
                model(suffix, **{kw: fresh(model, c, args.tokens)}).logits[0, -1].argmax().item()

            print(row.format("suffix forward against the loaded cache", codec, *timed(forward, args.rounds)))

            def whole(c: EngramPrefixCache = cache) -> None:
                past = c.load(ids)
                model(ids[:, c.last_loaded :], **{kw: past}).logits[0, -1].argmax().item()

            print(row.format("TTFT: load + suffix forward", codec, *timed(whole, args.rounds)))
            if not profiled:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    forward()
                    torch.cuda.synchronize()
                profiled = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                     max_name_column_width=50)
    print("\nThe suffix forward, transformers' own (sdpa, DynamicCache), by operator:\n" + stock_profile)
    print("\nThe suffix forward against the loaded cache (GQA attention, room), by operator:\n" + profiled)


if __name__ == "__main__":
    main()
