"""What a vLLM step waits for when it saves a prompt to Engram, with the put in the step or in the background.

The vLLM connector's worker side (engram.integrations.vllm.EngramWorker) against a real `engram serve`
subprocess, on vLLM-shaped paged caches of a Llama-3-8B-shaped model (32 layers, 8 KV heads x 128, bf16,
16-token vLLM blocks, 256-token Engram blocks) on the GPU. A "step" gathers each layer's KV out of the
prompt's blocks (save_kv_layer) and calls wait_for_save, as vLLM does in the step that completes a prompt:

- step ms: how long wait_for_save holds the step (sync: the whole put; async: handing it to the background);
- stored ms: from the start of wait_for_save until the prompt is stored (async: flush);
- load ms: a load of another stored prompt of the same length into vLLM's blocks (what the next step does
  for a hit), alone, and while the put of a save is still running in the background (which gives way to it,
  engram/loadgate.py; --no-give-way turns that off for a comparison);
- stored ms, load running: that put's stored ms, the load within it.

Medians of ROUNDS rounds after a warm-up (each round saves a new prompt). Run:

    python -m benchmarks.vllm_save [--tokens 8192,32768] [--codecs raw,nvfp4] [--json FILE]
    python -m benchmarks.vllm_save --smoke          # tiny shapes on the CPU, seconds
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks._harness import engram_daemon, machine, write_rows
from engram.integrations.registration import Registration
from engram.integrations.vllm import ConnectorConfig, EngramWorker, LayerCache, VllmLayers
from engram.integrations.vllm.scheduler import EngramMetadata, LoadSpec, SaveSpec

ROUNDS = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    def __init__(self, address: str, codec: str, async_saves: bool, shape: dict[str, int], device: torch.device,
                 blocks: int, give_way: bool = True) -> None:
        self.shape, self.device, self.bs = shape, device, shape["block_size"]
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape["layers"])]
        self.layers = VllmLayers.from_caches([LayerCache(n, "full", shape["heads"], shape["dim"], shape["dim"],
                                                         torch.bfloat16, self.bs) for n in self.names])
        cfg = ConnectorConfig.from_extra({"address": address, "namespace": f"bench-{codec}-{async_saves}",
                                          "codec": codec, "block_tokens": shape["block_tokens"],
                                          "async_saves": async_saves})
        spec = cfg.model_spec(self.layers, name="llama-8b-shaped", weights_id="random")
        self.client = cfg.client()
        model = Registration(self.client, spec)
        model.register()
        self.worker = EngramWorker(model, self.layers, namespace=cfg.namespace, save_client=cfg.save_client(spec))
        gen = torch.Generator(device=device).manual_seed(0)
        self.caches = {n: torch.randn((blocks, shape["heads"], self.bs, 2 * shape["dim"]), generator=gen,
                                      dtype=torch.bfloat16, device=device) for n in self.names}
        self.worker.register_kv_caches(self.caches)
        if not give_way and self.worker.save_client is not None:
            self.worker.save_client.give_way_to(None)
        self.rng = np.random.default_rng(1)

    def close(self) -> None:
        self.worker.close()
        self.client.close()

    def prompt(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(0, 128_000, n)]

    def step(self, tokens: list[int], block_ids: list[int]) -> float:
        """The step that completes a prompt: each layer's save hook, then wait_for_save (timed)."""
        meta = EngramMetadata(saves=[SaveSpec("r", tokens, block_ids)])
        for name in self.names:
            self.worker.save_layer(name, meta)
        t0 = time.perf_counter()
        self.worker.wait_for_save(meta)
        return time.perf_counter() - t0

    def load(self, tokens: list[int], block_ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.worker.start_load(EngramMetadata(loads=[LoadSpec("l", tokens, 0, block_ids)]))
        sync(self.device)
        if self.worker.take_load_errors():
            raise RuntimeError("the load found less than was stored")
        return time.perf_counter() - t0


def run(address: str, codec: str, async_saves: bool, n: int, shape: dict[str, int], device: torch.device,
        give_way: bool = True) -> dict[str, Any]:
    per_prompt = -(-n // shape["block_size"])
    b = Bench(address, codec, async_saves, shape, device, 2 * per_prompt, give_way)
    save_ids, load_ids = list(range(per_prompt)), list(range(per_prompt, 2 * per_prompt))
    try:
        stored = b.prompt(n)
        b.step(stored, save_ids)  # warm-up: maps the pool, compiles the kernels; and a prompt to load
        b.worker.flush()
        b.load(stored, load_ids)
        steps, dones, quiet, busy, busy_dones = [], [], [], [], []
        for _ in range(ROUNDS + 1):
            quiet.append(b.load(stored, load_ids))
            t0 = time.perf_counter()
            steps.append(b.step(b.prompt(n), save_ids))
            b.worker.flush()
            dones.append(time.perf_counter() - t0)
            if async_saves:  # again, and the next step's hit while the put runs
                t0 = time.perf_counter()
                b.step(b.prompt(n), save_ids)
                busy.append(b.load(stored, load_ids))
                b.worker.flush()
                busy_dones.append(time.perf_counter() - t0)
        if b.worker.save_failures:
            raise RuntimeError(f"{b.worker.save_failures} saves failed")
    finally:
        b.close()

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs[1:]) * 1e3, 1)

    return {"codec": codec, "saves": "async" if async_saves else "sync", "tokens": n, "step_ms": ms(steps),
            "stored_ms": ms(dones), "load_ms": ms(quiet), "load_during_put_ms": ms(busy) if busy else None,
            "stored_during_load_ms": ms(busy_dones) if busy_dones else None, "gate_waits": b.worker.gate.waits,
            "gate_waited_ms": round(b.worker.gate.waited_s * 1e3, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| codec | saves | tokens | step ms | stored ms | load ms | load ms, put running | stored ms, load running |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        busy = "-" if r["load_during_put_ms"] is None else f"{r['load_during_put_ms']:.1f}"
        later = "-" if r["stored_during_load_ms"] is None else f"{r['stored_during_load_ms']:.1f}"
        out.append(f"| {r['codec']} | {r['saves']} | {r['tokens']} | {r['step_ms']:.1f} | {r['stored_ms']:.1f} | "
                   f"{r['load_ms']:.1f} | {busy} | {later} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--codecs", default="raw,nvfp4")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--no-give-way", action="store_true", help="background puts do not give way to loads")
    args = ap.parse_args()
    if args.smoke:
        shape = {"layers": 2, "heads": 2, "dim": 16, "block_size": 16, "block_tokens": 32}
        device, tokens, dram = torch.device("cpu"), [256], "256MiB"
    else:
        shape = {"layers": 32, "heads": 8, "dim": 128, "block_size": 16, "block_tokens": 256}
        device, tokens, dram = torch.device("cuda"), [int(t) for t in args.tokens.split(",")], "16GiB"
    print(f"# vllm_save {datetime.date.today()} on {machine()}"
          + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    rows = []
    with engram_daemon("unix", dram=dram) as address:
        for codec in args.codecs.split(","):
            for n in tokens:
                for async_saves in (False, True):
                    rows.append(run(address, codec, async_saves, n, shape, device, not args.no_give_way))
                    print(rows[-1], flush=True)
    print(table(rows))
    if args.json:
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()
