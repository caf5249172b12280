"""Two agent sessions that share a long prefix (a system prompt and a repository), with and without Engram,
printing the time to first token of each.

    python examples/agent_sessions.py                      # a tiny random Llama on the CPU, ~20 s
    python examples/agent_sessions.py --model /models/x    # any local transformers causal LM directory

An `engram serve` daemon is started for the example (a unix socket in a temporary directory, its defaults: a
DRAM pool, no GPU or Redis needed). The first session pays the prefill and stores its KV; the second, in the same
process here but possibly another worker in practice, loads the shared prefix and prefills only its question.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def tiny_llama() -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def wait_ready(sock: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("engram serve did not start")
        time.sleep(0.1)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a local transformers model directory (default: a tiny random Llama)")
    ap.add_argument("--prefix", type=int, default=4096, help="tokens both sessions share")
    ap.add_argument("--codec", default="nvfp4", help="raw, nvfp4, mxfp4 or fp8_e4m3")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from engram.client import SyncEngramClient
    from engram.integrations.transformers import EngramPrefixCache, generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval() if args.model else tiny_llama()
    model = model.to(device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (1, args.prefix), generator=g)
    questions = [torch.randint(0, vocab, (1, 24), generator=g) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "engram.sock"
        proc = subprocess.Popen([sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock),
                                 "--dram-capacity", "2GiB", "--log-level", "warning"], cwd=tmp,
                                env={**os.environ, "ENGRAM_TIERS__DRAM__SHM_DIR": os.environ.get("ENGRAM_SHM", "/dev/shm")})
        try:
            wait_ready(sock, proc)
            with SyncEngramClient(f"unix:{sock}", namespace="agents") as client:
                cache = EngramPrefixCache(model, client, codec=args.codec)
                for i, q in enumerate(questions):
                    ids = torch.cat([shared, q], dim=1).to(device)
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=1, do_sample=False)
                    plain = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    generate(model, ids, cache, max_new_tokens=1, do_sample=False)
                    with_engram = time.perf_counter() - t0
                    print(f"session {i + 1}: {ids.shape[1]} tokens, {cache.last_loaded} from Engram; "
                          f"TTFT {plain * 1e3:.0f} ms without, {with_engram * 1e3:.0f} ms with Engram")
        finally:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
