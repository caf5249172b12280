"""Time to first token with and without Engram, for shared prefixes of a Llama-3-8B-shaped model.

A real `engram serve` subprocess (a shared DRAM pool, and on a GPU an HBM pool on the same device) and a
worker in this process running a random-weight Llama-3-8B-shaped model (32 layers, 32 heads, 8 KV heads x 128,
hidden 4096, bf16, sdpa) through transformers. The longest prefix is prefilled once and its KV stored
(`EngramPrefixCache.store`: in place, raw or nvfp4). Then for each prefix length N a new request (the prefix and
a SUFFIX-token question) is answered:

- without Engram: the whole prompt prefilled, then the first token (argmax of the last logits);
- with Engram: `EngramPrefixCache.load` (GetPrefix, the blocks DMAed into the model's cache tensors, nvfp4
  decoded on the GPU), the suffix prefilled against it, then the first token. EngramPrefixCache switches the model
  to its GQA-aware attention (engram/integrations/hf_attention.py) unless `--stock-attention`; the "without" figures
  are taken before, with transformers' sdpa.

`--compile`: the worker's forward compiled (`torch.compile(model.forward, dynamic=True)`) for both paths, so that
a forward of a few tokens is not bound by eager transformers' kernel launches (30-40 ms on the lent hosts,
whatever the context). Dynamic shapes: one compilation serves every prefix length; the loaded cache's append and
the attention run eagerly between the compiled parts (engram/integrations). Compilation happens in the untimed
warm-up requests.

Tiers: "dram" (blocks in the daemon's shared pool), "hbm" (after a first hit the daemon promotes the blocks into
its HBM pool in the background, and the next hits copy them device to device through CUDA IPC). Each figure is
the median of ROUNDS requests after a warm-up; `match` says whether both paths chose the same first token.

    python -m benchmarks.ttft [--tokens 1024,4096,16384,32768] [--codecs raw,nvfp4] [--json FILE]
    python -m benchmarks.ttft --compile [...]  # the worker's forward compiled (torch.compile, dynamic shapes)
    python -m benchmarks.ttft --smoke          # a tiny model on the CPU, under a minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness import engram_daemon, machine, write_rows
from engram.client import SyncEngramClient
from engram.integrations.transformers import EngramPrefixCache, cache_kwarg

# `python -m benchmarks.ttft` puts the repository root on sys.path, where kernels/ (engram.kernels) would shadow
# Hugging Face's `kernels` package that transformers imports; engram itself is installed, so the root can go.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


def build_model(smoke: bool, device: torch.device) -> Any:
    import transformers as tf

    if smoke:
        cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=65536)
        dtype = torch.float32
    else:
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=65536, rope_theta=500000.0)
        dtype = torch.bfloat16
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def first_token_plain(model: Any, ids: torch.Tensor) -> tuple[int, float]:
    sync(ids.device)
    t0 = time.perf_counter()
    tok = int(model(ids).logits[0, -1].argmax())
    sync(ids.device)
    return tok, time.perf_counter() - t0


@torch.inference_mode()
def first_token_engram(model: Any, cache: EngramPrefixCache, ids: torch.Tensor) -> tuple[int, float, int]:
    sync(ids.device)
    t0 = time.perf_counter()
    past = cache.load(ids)
    m = cache.last_loaded
    tok = int(model(ids[:, m:], **{cache_kwarg(model): past}).logits[0, -1].argmax())
    sync(ids.device)
    return tok, time.perf_counter() - t0, m


def requests(args: argparse.Namespace, model: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """Each length's request: the first N tokens of one shared prefix and a question of its own."""
    sizes = [int(x) for x in args.tokens.split(",")]
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, max(sizes)), generator=torch.Generator().manual_seed(1)).to(device)
    return {n: torch.cat([prefix[:, :n], torch.randint(0, vocab, (1, args.suffix),
                                                       generator=torch.Generator().manual_seed(n)).to(device)], dim=1)
            for n in sizes}


def run(address: str, tier: str, args: argparse.Namespace, model: Any, device: torch.device,
        plain: dict[int, tuple[int, float]], asks: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
    """One daemon: each codec's prefix stored, then the requests of every length (their hits from `tier`)."""
    from transformers import DynamicCache

    prefix = asks[max(asks)][:, : max(asks)]
    rows: list[dict[str, Any]] = []
    for codec in args.codecs.split(","):
        with SyncEngramClient(address, namespace=f"ttft-{codec}") as client:
            cache = EngramPrefixCache(model, client, codec=codec, weights_id="random-llama-3-8b-shaped",
                                      gqa_attention=not args.stock_attention)
            with torch.inference_mode():
                dyn = DynamicCache(config=model.config)
                model(prefix, **{cache_kwarg(model): dyn})
                cache.store(prefix[0].tolist(), dyn)
                del dyn
            for n, ids in asks.items():
                first_token_engram(model, cache, ids)  # warm-up (from DRAM: the trigger of HBM promotion)
                if tier == "hbm":  # wait until the daemon has promoted the blocks
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline and any(
                            b.tier != "hbm" for b in client.lookup(cache.fingerprint, ids[0, :n].tolist()).blocks):
                        time.sleep(0.1)
                got = [first_token_engram(model, cache, ids) for _ in range(args.rounds)]
                where = {b.tier for b in client.lookup(cache.fingerprint, ids[0, :n].tolist()).blocks}
                ttft = statistics.median(s[1] for s in got)
                rows.append({"tokens": n, "tier": tier, "codec": codec, "ttft_ms": ttft * 1e3,
                             "prefill_ms": plain[n][1] * 1e3, "speedup": plain[n][1] / ttft,
                             "loaded": got[0][2], "served_from": ",".join(sorted(where)),
                             "match": got[0][0] == plain[n][0], "compiled": args.compile})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| tokens | tier | codec | TTFT ms | prefill ms | speedup | cached tokens | blocks in | same token |",
           "|---:|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        out.append(f"| {r['tokens']} | {r['tier']} | {r['codec']} | {r['ttft_ms']:.1f} | {r['prefill_ms']:.1f} | "
                   f"{r['speedup']:.1f}x | {r['loaded']} | {r['served_from']} | {'yes' if r['match'] else 'no'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="1024,4096,16384,32768")
    ap.add_argument("--codecs", default="raw,nvfp4")
    ap.add_argument("--suffix", type=int, default=32, help="tokens of the new question after the shared prefix")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-hbm", dest="hbm", action="store_false", help="no HBM tier in the daemon")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, 512 and 2048 tokens")
    ap.add_argument("--stock-attention", action="store_true",
                    help="the worker keeps transformers' sdpa attention (EngramPrefixCache(gqa_attention=False))")
    ap.add_argument("--compile", action="store_true",
                    help="compile the worker's forward (torch.compile, dynamic shapes) for both paths")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.tokens, args.rounds, args.hbm = "cpu", "512,2048", 3, False
    device = torch.device(args.device)
    model = build_model(args.smoke, device)
    with torch.inference_mode():
        model(torch.zeros(1, 256, dtype=torch.long, device=device))  # kernels compiled before anything is timed
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    asks = requests(args, model, device)
    plain: dict[int, tuple[int, float]] = {}  # without Engram: transformers' own sdpa (before any EngramPrefixCache)
    for n, ids in asks.items():
        first_token_plain(model, ids)
        samples = [first_token_plain(model, ids) for _ in range(args.rounds)]
        plain[n] = (samples[0][0], statistics.median(s[1] for s in samples))
    rows: list[dict[str, Any]] = []
    for tier in ["dram", "hbm"] if device.type == "cuda" and args.hbm else ["dram"]:
        extra: tuple[str, ...] = ()
        if tier == "hbm":  # a daemon with an HBM pool on this GPU: hits from DRAM promote blocks there
            extra = ("--set", "tiers.hbm.capacity=12GiB", "--set", f"tiers.hbm.device={device}")
        with engram_daemon("unix", dram="12GiB" if not args.smoke else "1GiB", extra=extra) as address:
            rows += run(address, tier, args, model, device, plain, asks)
    print(f"ttft, {datetime.date.today()}, {machine()}, device {args.device}, worker attention "
          f"{'sdpa' if args.stock_attention else 'engram_sdpa'}, forward {'compiled' if args.compile else 'eager'}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    print(table(rows))
    if args.json:
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()
