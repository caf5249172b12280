"""What bounded replay costs against loading the same SWA window from a tier: `engram bench replay` and
`python -m benchmarks.replay_cost` (issue 20; docs/REPLAY.md, "Benchmark: replay cost").

For one model (a named random-weight HybridDecoder of real shape, or a Hugging Face checkpoint directory) it
measures:

1. replay time against R (W, 2W, 4W, ... and the exact bound L_swa * (W - 1)) and the context N: the fastest of
   several `reconstruct_swa` calls (CUDA-synchronized on a GPU), with the Reconstruction's token_layers;
2. the time to load the same window's bytes from HBM (device-to-device copy; CUDA only), DRAM (pinned host ->
   device on CUDA, else a host copy into a fresh tensor) and NVMe (a file read with O_DIRECT where the file system
   takes it, else after dropping the file's cached pages with posix_fadvise, else through the page cache), at the
   window's size and at larger ones, so a latency + bandwidth line can be fitted per tier;
3. fidelity against R over a fixed, seeded prompt set: the rebuilt window's K/V relative error (window_error),
   and the next token's KL divergence and top-1 agreement (decode_next with the rebuilt window vs the true one);
4. the bytes a session persists with replay (global KV only) and without it (global KV + the window).

It writes replay_cost.json (schema "engram.replay_cost/1", below; a cost model calibrates from it),
replay_cost.md and replay_cost.png. matplotlib (the `bench` extra) is imported only to draw the plot.

What it does not do: time a full prefill (benchmarks/replay_bound.py does), batch sessions, or pick a mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import mmap
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engram.replay.config import HybridConfig, gemma3_pattern, gpt_oss_pattern
from engram.replay.costmodel import Calibration, FidelityFloor, machine_id, policy_check, report
from engram.replay.decoder import HybridDecoder
from engram.replay.model import PrefillResult, ReplayError, ReplayModel, ReplaySpec
from engram.replay.numerics import Numerics
from engram.replay.reconstruct import ReplayMode, decode_next, exact_bound, reconstruct_swa, window_error

SCHEMA = "engram.replay_cost/1"
FILES = ("replay_cost.json", "replay_cost.md", "replay_cost.png")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}

# Random-weight HybridDecoders of real models' attention shapes. The MLP is dense, as wide as the active experts
# together (gpt-oss: 4 of intermediate 2880), so a token costs about the model's active FLOPs. Attention sinks are
# off: the reference decoder's sink path materializes every score (N x N per head), which a 64K prefill cannot
# hold; a sink adds one logit per head and changes neither the replay's work nor its bound.
NAMED: dict[str, HybridConfig] = {
    "tiny": HybridConfig(layers=gpt_oss_pattern(8), window=8, vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2,
                         head_dim=16, d_ff=128),
    "gpt-oss-20b": HybridConfig(layers=gpt_oss_pattern(24), window=128, vocab_size=201_088, d_model=2880,
                                n_heads=64, n_kv_heads=8, head_dim=64, d_ff=4 * 2880, rope_theta=150_000.0),
    "gpt-oss-120b": HybridConfig(layers=gpt_oss_pattern(36), window=128, vocab_size=201_088, d_model=2880,
                                 n_heads=64, n_kv_heads=8, head_dim=64, d_ff=4 * 2880, rope_theta=150_000.0),
    "gemma3-4b": HybridConfig(layers=gemma3_pattern(34), window=1024, vocab_size=262_144, d_model=2560, n_heads=8,
                              n_kv_heads=4, head_dim=256, d_ff=10_240, rope_theta=1_000_000.0),
}

DEFAULT_MODEL = "gpt-oss-20b"
SMOKE_CONTEXTS = (64, 128, 256)
GPU_CONTEXTS = (4096, 16384, 65536)
LOAD_FACTORS = (1, 4, 16, 64, 256)  # load sizes: the window's bytes times these
SMOKE_LOAD_FACTORS = (1, 16, 256)


@dataclass
class BenchOptions:
    model: str | None = None  # a name of NAMED or a Hugging Face checkpoint directory; None: DEFAULT_MODEL
    # ("tiny" with smoke)
    contexts: tuple[int, ...] = ()  # N; empty: SMOKE_CONTEXTS with smoke, else GPU_CONTEXTS
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    out: Path = field(default_factory=lambda: Path("replay-cost"))
    smoke: bool = False  # tiny model, small contexts, few repeats: end to end on a CPU in seconds
    repeats: int = 0  # timed runs per figure (the fastest is kept); 0: 3 with smoke, else 20
    prompts: int = 0  # fidelity prompt set; 0: 4 with smoke, else 8
    fidelity_context: int = 0  # prompt length; 0: the smallest context >= exact bound + W (or that sum)
    nvme_dir: str | None = None  # where the NVMe file is written; None: a temporary directory
    seed: int = 0  # weights of a named model, and the prompts


# ---------------------------------------------------------------- models


@dataclass
class LoadedModel:
    model: ReplayModel
    name: str
    source: str  # "named" | "checkpoint"
    weights_id: str
    vocab_size: int
    layers: int


def build_model(name_or_path: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    from engram.replay.runtime import weights_identity

    if Path(name_or_path).is_dir():
        from engram.replay.hf import load_checkpoint

        # As the daemon loads it (replay.models), so the weights id is the one its calibration is found by.
        hf = load_checkpoint(name_or_path, device=device, dtype=dtype)
        text = hf.model.config.get_text_config(decoder=True)
        return LoadedModel(hf, Path(name_or_path).resolve().name, "checkpoint", hf.weights_identity(),
                           int(text.vocab_size), len(hf.replay_spec.kinds))
    if name_or_path not in NAMED:
        raise ReplayError(f"--model {name_or_path!r} is neither a checkpoint directory nor a named config "
                          f"({', '.join(NAMED)})")
    cfg = dataclasses.replace(NAMED[name_or_path], dtype=dtype, seed=seed)
    decoder = HybridDecoder(cfg, device=device, numerics=Numerics.FAST)
    return LoadedModel(decoder, name_or_path, "named", weights_identity(decoder), cfg.vocab_size, cfg.n_layers)


def _prefill(model: ReplayModel, tokens: Tensor) -> PrefillResult:
    if isinstance(model, HybridDecoder):
        return model.prefill(tokens, logits=False)
    return model.prefill(tokens)  # type: ignore[attr-defined]  # HFReplayModel


# ---------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3,
                 before: Callable[[], Any] | None = None) -> float:
    """The fastest wall time of fn over `repeats` runs after `warmup`, synchronized on CUDA; `before` runs off
    the clock ahead of each run (e.g. dropping a file's cached pages). The fastest, not the median: on the H200
    the medians of identical replays moved by +-15% within a run and 17-27 ms between runs (clock and
    host states), which no cost model can predict; the fastest is what the work costs."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def replay_lengths(spec: ReplaySpec) -> list[tuple[int, str]]:
    """(R, label): W, 2W, 4W, ... below the exact bound, then the bound itself ("exact")."""
    bound, w = exact_bound(spec), spec.window
    out, k = [], 1
    while bound and k * w < bound:
        out.append((k * w, "W" if k == 1 else f"{k}W"))
        k *= 2
    out.append((bound, "exact"))
    return out


def window_bytes(spec: ReplaySpec, context: int | None = None) -> int:
    """Sliding layers x 2 x (W - 1) x KV heads x head dim x dtype size (fewer rows for a context under W - 1)."""
    rows = spec.window - 1 if context is None else min(spec.window - 1, context)
    return len(spec.sliding_layers) * 2 * rows * spec.n_kv_heads * spec.head_dim * spec.dtype.itemsize


def global_bytes(spec: ReplaySpec, context: int) -> int:
    per_token = math.prod(spec.global_k_shape) + math.prod(spec.global_v_shape)
    return len(spec.stored_layers) * context * per_token * spec.dtype.itemsize


def _read_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], done)
        if n <= 0:
            raise OSError(f"short read at {done} of {len(view)} bytes")
        done += n


def _fs_type(path: Path) -> str:
    best, fs = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and str(path.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fs = parts[1], parts[2]
    return fs


class NvmeReader:
    """Reads a file of `nbytes` (rounded up to 4 KiB) into a page-aligned host buffer (pinned on CUDA where the
    allocator hands out aligned memory), then copies it onto the device on CUDA. `method` says how the page
    cache was kept out: "O_DIRECT", "fadvise" (the file's pages dropped with posix_fadvise(DONTNEED) before each
    read; the kernel may keep some) or "page cache" (neither worked)."""

    def __init__(self, directory: Path, nbytes: int, device: torch.device) -> None:
        self.size = -(-nbytes // 4096) * 4096
        self.path = directory / f"engram-replay-cost-{os.getpid()}-{nbytes}.bin"
        chunk = os.urandom(min(self.size, 1 << 20))
        with open(self.path, "wb") as fh:
            for at in range(0, self.size, len(chunk)):
                fh.write(chunk[: self.size - at])
            fh.flush()
            os.fsync(fh.fileno())
        self.mm: mmap.mmap | None = None
        self.dst = torch.empty(self.size, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        pinned = torch.empty(self.size, dtype=torch.uint8, pin_memory=True) if self.dst is not None else None
        if pinned is not None and pinned.data_ptr() % 4096 == 0:
            self.host, self.pinned = pinned, True
        else:
            self.mm = mmap.mmap(-1, self.size)  # page-aligned, as O_DIRECT wants
            self.host, self.pinned = torch.frombuffer(self.mm, dtype=torch.uint8), False
        self.view = self.host.numpy().data
        self.method = "O_DIRECT"
        try:  # file systems without O_DIRECT refuse the open or the read with EINVAL
            self.read()
        except (OSError, AttributeError):
            self.method = "fadvise" if hasattr(os, "posix_fadvise") else "page cache"

    def describe(self) -> str:
        if self.dst is None:
            return f"{self.method} reads into host memory"
        return f"{self.method} reads into {'pinned' if self.pinned else 'pageable'} host memory, then a copy to the device"

    def drop(self) -> None:
        if self.method == "fadvise":
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def read(self) -> None:
        flags = os.O_RDONLY | (os.O_DIRECT if self.method == "O_DIRECT" else 0)  # AttributeError: no O_DIRECT
        fd = os.open(self.path, flags)
        try:
            _read_all(fd, self.view)
        finally:
            os.close(fd)
        if self.dst is not None:
            self.dst.copy_(self.host, non_blocking=self.pinned)  # best_seconds synchronizes

    def close(self) -> None:
        self.view.release()
        del self.host
        if self.mm is not None:
            self.mm.close()
        self.path.unlink(missing_ok=True)


def _fresh_copy(src: Tensor) -> Tensor:
    return torch.empty_like(src).copy_(src)


def measure_loads(nbytes: int, device: torch.device, factors: Sequence[int], repeats: int, nvme_dir: Path,
                  step: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Median seconds to bring nbytes x each factor onto the device from each tier; and notes on how."""
    rows: list[dict[str, Any]] = []
    notes = {"nvme": ""}
    cuda = device.type == "cuda"
    if cuda:
        # One pinned buffer and one device pair for every size, sliced: a fresh pinned allocation per size made
        # the first size's copies run at pageable speed in one H200 run (1.1 ms for 3 MB, 0.07 ms in another).
        top = nbytes * max(factors)
        host_all = torch.empty(top, dtype=torch.uint8, pin_memory=True)
        src_all = torch.empty(top, dtype=torch.uint8, device=device)
        dst_all = torch.empty(top, dtype=torch.uint8, device=device)
    for factor in factors:
        n = nbytes * factor
        if cuda:
            src, dst, host = src_all[:n], dst_all[:n], host_all[:n]
            rows.append({"tier": "hbm", "bytes": n,
                         "seconds": best_seconds(functools.partial(dst.copy_, src), device, repeats, warmup=2)})
            rows.append({"tier": "dram", "bytes": n, "seconds": best_seconds(
                functools.partial(dst.copy_, host, non_blocking=True), device, repeats, warmup=2)})
        else:
            host = torch.randint(0, 255, (n,), dtype=torch.uint8)
            rows.append({"tier": "dram", "bytes": n, "seconds": best_seconds(
                functools.partial(_fresh_copy, host), device, repeats, warmup=2)})
            del host
        step(f"load {n:,} B from hbm/dram")
        reader = NvmeReader(nvme_dir, n, device)
        try:
            secs = best_seconds(reader.read, device, max(3, repeats // 2), warmup=1, before=reader.drop)
            # the file is rounded up to 4 KiB for O_DIRECT; the time is charged to the window's bytes
            rows.append({"tier": "nvme", "bytes": n, "seconds": secs})
            notes["nvme"] = f"{reader.describe()}, from a file in {nvme_dir} ({_fs_type(nvme_dir)})"
        finally:
            reader.close()
        step(f"load {n:,} B from nvme")
    return rows, notes


def _kl_top1(ref_logits: Tensor, logits: Tensor) -> tuple[float, bool]:
    ref = torch.log_softmax(ref_logits.double(), -1)
    got = torch.log_softmax(logits.double(), -1)
    kl = float((ref.exp() * (ref - got)).sum())
    return max(kl, 0.0), bool(ref_logits.argmax() == logits.argmax())


def measure_fidelity(model: ReplayModel, vocab: int, lengths: Sequence[tuple[int, str]], context: int,
                     prompts: int, seed: int, step: Callable[[str], None]) -> list[dict[str, Any]]:
    """Per R: the largest window_error over the prompts, and the mean next-token KL and top-1 agreement of
    decode_next with the rebuilt window against decode_next with the prefill's."""
    errors: dict[int, list[float]] = {r: [] for r, _ in lengths}
    kls: dict[int, list[float]] = {r: [] for r, _ in lengths}
    top1: dict[int, list[bool]] = {r: [] for r, _ in lengths}
    for i in range(prompts):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (i + 1))
        tokens = torch.randint(0, vocab, (context + 1,), generator=gen)
        pre = _prefill(model, tokens[:context])
        stored, truth = pre.stored_global_kv(context), pre.swa_window(context)
        del pre
        ref = decode_next(model, tokens[context], stored, truth).logits
        for r, _ in lengths:
            rec = reconstruct_swa(model, tokens[:context], stored, ReplayMode.fixed(r))
            errors[r].append(window_error(rec.window, truth))
            kl, same = _kl_top1(ref, decode_next(model, tokens[context], stored, rec.window).logits)
            kls[r].append(kl)
            top1[r].append(same)
        step(f"fidelity prompt {i + 1}/{prompts}")
    return [{"replayed": r, "label": label, "kv_rel_error": max(errors[r]), "kl": statistics.fmean(kls[r]),
             "top1": sum(top1[r]) / len(top1[r])} for r, label in lengths]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ReplayError(f"--device takes auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ReplayError("--device cuda: no CUDA device is available here")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ReplayError(f"--dtype takes auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def defaults(opts: BenchOptions) -> BenchOptions:
    """Fill the 0 / empty options from --smoke."""
    return BenchOptions(
        model=opts.model or ("tiny" if opts.smoke else DEFAULT_MODEL),
        contexts=tuple(opts.contexts) or (SMOKE_CONTEXTS if opts.smoke else GPU_CONTEXTS),
        device="cpu" if opts.smoke and opts.device == "auto" else opts.device,
        dtype=opts.dtype, out=opts.out, smoke=opts.smoke,
        repeats=opts.repeats or (3 if opts.smoke else 20), prompts=opts.prompts or (4 if opts.smoke else 8),
        fidelity_context=opts.fidelity_context, nvme_dir=opts.nvme_dir, seed=opts.seed)


@contextlib.contextmanager
def _nvme_directory(given: str | None) -> Iterator[Path]:
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="engram-replay-cost-") as tmp:
        yield Path(tmp)


Step = Callable[[str], None]
StepsFactory = Callable[[int], Step]  # given the number of steps, returns what each finished step calls


def run(opts: BenchOptions, progress: StepsFactory | None = None) -> dict[str, Any]:
    """Measure everything and return the result, schema "engram.replay_cost/1". Contexts shorter than a
    replay length skip that length (a replay cannot start before token 0)."""
    opts = defaults(opts)
    if min(opts.contexts) < 1 or opts.repeats < 1 or opts.prompts < 1:
        raise ReplayError("contexts, repeats and prompts must be positive")
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    threads = torch.get_num_threads()
    if opts.smoke and device.type == "cpu":
        # the tiny model's matrices gain nothing from threads, and on a loaded machine OpenMP's waiting threads
        # make each small op slower by orders of magnitude (measured: 2.6 ms per 64-wide linear with 2 threads)
        torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return _run(opts, device, dtype, progress)
    finally:
        torch.set_num_threads(threads)


def _run(opts: BenchOptions, device: torch.device, dtype: torch.dtype, progress: StepsFactory | None) -> dict[str, Any]:
    assert opts.model is not None  # defaults() filled it
    loaded = build_model(opts.model, device, dtype, opts.seed)
    model, spec = loaded.model, loaded.model.replay_spec
    if not spec.sliding_layers or not spec.stored_layers:
        raise ReplayError(f"{loaded.name} needs both sliding and global layers to compare replay with a load")
    lengths = replay_lengths(spec)
    bound, w = exact_bound(spec), spec.window
    fid_ctx = opts.fidelity_context or next((n for n in sorted(opts.contexts) if n >= bound + w), bound + w)
    if fid_ctx <= bound:
        raise ReplayError(f"the fidelity context ({fid_ctx}) must exceed the exact bound ({bound}): a replay of a "
                          "shorter prefix starts at token 0 and is a prefill")
    factors = SMOKE_LOAD_FACTORS if opts.smoke else LOAD_FACTORS
    contexts = sorted(set(opts.contexts))
    if contexts[-1] < w:
        raise ReplayError(f"every context is shorter than one window (W = {w}): no replay length fits")
    total = sum(1 + sum(r <= n for r, _ in lengths) for n in contexts) + 2 * len(factors) + opts.prompts
    step: Step = progress(total) if progress else (lambda label: None)

    replay_rows: list[dict[str, Any]] = []
    for n in contexts:
        tokens = torch.randint(0, loaded.vocab_size, (n,), generator=torch.Generator().manual_seed(opts.seed + n))
        pre = _prefill(model, tokens)
        stored = pre.stored_global_kv(n)
        del pre
        step(f"prefill N={n}")
        for r, label in lengths:
            if r > n:
                continue
            mode = ReplayMode.fixed(r)
            rec = reconstruct_swa(model, tokens, stored, mode)
            secs = best_seconds(functools.partial(reconstruct_swa, model, tokens, stored, mode), device,
                                  opts.repeats)
            replay_rows.append({"context": n, "replayed": rec.replayed, "label": label, "seconds": secs,
                                "token_layers": rec.token_layers})
            step(f"replay N={n} R={label} ({r})")
        del stored
        if device.type == "cuda":
            torch.cuda.empty_cache()

    with _nvme_directory(opts.nvme_dir) as nvme_dir:
        loads, notes = measure_loads(window_bytes(spec), device, factors, opts.repeats, nvme_dir, step)
    fidelity = measure_fidelity(model, loaded.vocab_size, lengths, fid_ctx, opts.prompts, opts.seed, step)
    return {
        "schema": SCHEMA,
        "model": {"name": loaded.name, "source": loaded.source, "weights_id": loaded.weights_id,
                  "layers": loaded.layers, "sliding_layers": len(spec.sliding_layers),
                  "global_layers": loaded.layers - len(spec.sliding_layers), "window": w,
                  "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
                  "dtype": str(spec.dtype).removeprefix("torch.")},
        "machine": {"id": machine_id(str(device)), "device": device.type,
                    "device_name": _device_name(device), "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "replay": replay_rows,
        "load": loads,
        "fidelity": fidelity,
        "persisted": [{"context": n, "global_bytes": global_bytes(spec, n), "window_bytes": window_bytes(spec, n)}
                      for n in contexts],
        # not in the schema's records: how the NVMe reads went, and the fidelity prompts (for the Markdown)
        "_notes": {**notes, "fidelity_context": fid_ctx, "prompts": opts.prompts, "exact_bound": bound},
    }


# ---------------------------------------------------------------- the schema


_KEYS: dict[str, dict[str, Any]] = {
    "model": {"name": str, "source": str, "weights_id": str, "layers": int, "sliding_layers": int,
              "global_layers": int, "window": int, "n_kv_heads": int, "head_dim": int, "dtype": str},
    "machine": {"id": str, "device": str, "device_name": str, "torch": str},
    "replay": {"context": int, "replayed": int, "label": str, "seconds": float, "token_layers": int},
    "load": {"tier": str, "bytes": int, "seconds": float},
    "fidelity": {"replayed": int, "label": str, "kv_rel_error": float, "kl": float, "top1": float},
    "persisted": {"context": int, "global_bytes": int, "window_bytes": int},
}


def public(result: dict[str, Any]) -> dict[str, Any]:
    """The result as the JSON file holds it: the schema's keys only."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


def validate(doc: dict[str, Any]) -> None:
    """Raise ValueError where doc strays from schema engram.replay_cost/1 (keys exactly, types, enums)."""

    def check(where: str, obj: Any, keys: dict[str, Any]) -> None:
        if not isinstance(obj, dict) or set(obj) != set(keys):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: keys {got}, want {sorted(keys)}")
        for key, typ in keys.items():
            value = obj[key]
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if typ is float else \
                (isinstance(value, typ) and not isinstance(value, bool))
            if not ok:
                raise ValueError(f"{where}.{key}: {value!r} is not {typ.__name__}")

    top = {"schema", "model", "machine", "date", "replay", "load", "fidelity", "persisted"}
    if set(doc) != top:
        raise ValueError(f"top-level keys {sorted(doc)}, want {sorted(top)}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema {doc['schema']!r}, want {SCHEMA!r}")
    datetime.date.fromisoformat(doc["date"])
    check("model", doc["model"], _KEYS["model"])
    check("machine", doc["machine"], _KEYS["machine"])
    if doc["model"]["source"] not in ("named", "checkpoint") or doc["machine"]["device"] not in ("cuda", "cpu"):
        raise ValueError("model.source must be named|checkpoint and machine.device cuda|cpu")
    for section in ("replay", "load", "fidelity", "persisted"):
        if not isinstance(doc[section], list) or not doc[section]:
            raise ValueError(f"{section} must be a non-empty list")
        for i, row in enumerate(doc[section]):
            check(f"{section}[{i}]", row, _KEYS[section])
    if {row["tier"] for row in doc["load"]} - {"hbm", "dram", "nvme"}:
        raise ValueError("load tiers are hbm, dram and nvme")


def write_json(result: dict[str, Any], path: Path) -> None:
    doc = public(result)
    validate(doc)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ---------------------------------------------------------------- reports


def fit_line(rows: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Least squares seconds = latency + bytes / bandwidth: (latency s, bandwidth B/s), or None (too few sizes,
    or no positive slope)."""
    xs, ys = [float(r["bytes"]) for r in rows], [float(r["seconds"]) for r in rows]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        return None
    return max(my - slope * mx, 0.0), 1.0 / slope


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def markdown(result: dict[str, Any]) -> str:
    m, mach, notes = result["model"], result["machine"], result.get("_notes", {})
    labels = list(dict.fromkeys(r["label"] for r in result["replay"]))
    by = {(r["context"], r["label"]): r for r in result["replay"]}
    contexts = sorted({r["context"] for r in result["replay"]})
    wbytes = min(r["bytes"] for r in result["load"])
    lines = [
        f"# Replay cost: {m['name']} ({m['source']}, {m['dtype']}) on {mach['device_name']} ({mach['device']}), "
        f"torch {mach['torch']}, {result['date']}",
        "",
        f"{m['layers']} layers ({m['sliding_layers']} sliding, {m['global_layers']} global), W = {m['window']}, "
        f"{m['n_kv_heads']} KV heads x {m['head_dim']}; exact R = {notes.get('exact_bound', '?')}. "
        f"Weights {m['weights_id']}. The SWA window is {wbytes:,} bytes ({_mib(wbytes)}).",
        "",
        "## Replay time (fastest of the timed runs, ms; token-layers run)",
        "",
        "| context | " + " | ".join(f"R = {lab}" for lab in labels) + " |",
        "| ---: | " + " | ".join("---:" for _ in labels) + " |",
    ]
    for n in contexts:
        cells = [f"{_ms(by[n, lab]['seconds'])} ({by[n, lab]['token_layers']:,})" if (n, lab) in by else "-"
                 for lab in labels]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    replayed = {r["label"]: r["replayed"] for r in result["replay"]}
    lines += ["", "R per label: " + ", ".join(f"{lab} = {replayed[lab]}" for lab in labels) + ".", "",
              "## Loading the window's bytes instead (fastest of the timed runs, ms)", "",
              "| tier | bytes | ms | fitted latency ms | fitted GB/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for tier in ("hbm", "dram", "nvme"):
        rows = [r for r in result["load"] if r["tier"] == tier]
        fit = fit_line(rows)
        for i, r in enumerate(rows):
            fitted = ("-", "-") if fit is None or i else (_ms(fit[0]), f"{fit[1] / 1e9:.3g}")
            lines.append(f"| {tier} | {r['bytes']:,} | {_ms(r['seconds'])} | {fitted[0]} | {fitted[1]} |")
    if notes.get("nvme"):
        lines += ["", f"NVMe: {notes['nvme']}."]
    exact = [r for r in result["replay"] if r["label"] == "exact"]
    if exact:
        last = max(exact, key=lambda r: r["context"])
        ratios = [f"{last['seconds'] / r['seconds']:.3g}x the {r['tier']} load" for r in result["load"]
                  if r["bytes"] == wbytes]
        lines += ["", f"Exact replay at N = {last['context']} takes {_ms(last['seconds'])} ms: "
                  + ", ".join(ratios) + " of the same window."]
    lines += ["", f"## Fidelity ({notes.get('prompts', '?')} seeded prompts of {notes.get('fidelity_context', '?')} "
              "tokens; decode with the rebuilt window vs the prefill's)", "",
              "| R | label | K/V rel. error (max) | next-token KL (mean) | top-1 agreement |",
              "| ---: | --- | ---: | ---: | ---: |"]
    for f in result["fidelity"]:
        lines.append(f"| {f['replayed']} | {f['label']} | {f['kv_rel_error']:.3g} | {f['kl']:.3g} | {f['top1']:.3f} |")
    lines += ["", "## Bytes persisted per session", "",
              "| context | with replay (global KV) | without replay (+ window) | saved |",
              "| ---: | ---: | ---: | ---: |"]
    for p in result["persisted"]:
        g, w = p["global_bytes"], p["window_bytes"]
        lines.append(f"| {p['context']} | {g:,} | {g + w:,} | {100 * w / (g + w):.2f}% |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Replay time vs R (a line per context) and vs N (a line per R), with the load of the window from each tier
    as horizontal lines; and load time vs bytes per tier. matplotlib's Agg canvas: no display, no pyplot state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 5), layout="constrained")
    ax_r, ax_n, ax_l = fig.subplots(1, 3)
    replay = result["replay"]
    wbytes = min(r["bytes"] for r in result["load"])
    colors = {"hbm": "tab:green", "dram": "tab:orange", "nvme": "tab:red"}
    for n in sorted({r["context"] for r in replay}):
        rows = sorted((r for r in replay if r["context"] == n), key=lambda r: r["replayed"])
        ax_r.plot([r["replayed"] for r in rows], [r["seconds"] * 1e3 for r in rows], "o-", label=f"N = {n}")
    for label in dict.fromkeys(r["label"] for r in replay):
        rows = sorted((r for r in replay if r["label"] == label), key=lambda r: r["context"])
        ax_n.plot([r["context"] for r in rows], [r["seconds"] * 1e3 for r in rows], "o-",
                  label=f"R = {label} ({rows[0]['replayed']})")
    for tier, color in colors.items():
        at_window = [r for r in result["load"] if r["tier"] == tier and r["bytes"] == wbytes]
        if at_window:
            for ax in (ax_r, ax_n):
                ax.axhline(at_window[0]["seconds"] * 1e3, color=color, ls="--", label=f"load window from {tier}")
        rows = [r for r in result["load"] if r["tier"] == tier]
        if rows:
            ax_l.plot([r["bytes"] for r in rows], [r["seconds"] * 1e3 for r in rows], "o", color=color, label=tier)
            fit = fit_line(rows)
            if fit:
                lo, hi = min(r["bytes"] for r in rows), max(r["bytes"] for r in rows)
                xs = [lo * (hi / lo) ** (i / 49) for i in range(50)]  # a smooth curve on log axes
                ax_l.plot(xs, [(fit[0] + x / fit[1]) * 1e3 for x in xs], "-", color=color,
                          label=f"{tier}: {fit[0] * 1e3:.2g} ms + B / {fit[1] / 1e9:.3g} GB/s")
    m = result["model"]
    ax_r.set(xlabel="tokens replayed R", ylabel="ms", title=f"replay time vs R ({m['name']}, {m['dtype']})",
             yscale="log")
    ax_r.set_xscale("log", base=2)
    ax_n.set(xlabel="context N (tokens)", ylabel="ms", title="replay time vs N", yscale="log")
    ax_n.set_xscale("log", base=2)
    ax_l.set(xlabel="bytes", ylabel="ms", title=f"load from a tier (window = {_mib(wbytes)})", xscale="log",
             yscale="log")
    for ax in (ax_r, ax_n, ax_l):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"Engram bounded replay vs load: {result['machine']['device_name']}, {result['date']}")
    fig.savefig(path, dpi=110)


def write_outputs(result: dict[str, Any], out: Path) -> tuple[list[Path], str | None]:
    """JSON, Markdown and (matplotlib permitting) PNG in `out`; returns the files and why the plot is missing."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out / name for name in FILES)
    write_json(result, json_path)
    md_path.write_text(markdown(result))
    try:
        import matplotlib  # noqa: F401  # the optional `bench` extra
    except ImportError:
        return [json_path, md_path], "matplotlib is not installed (pip install 'engram-kv[bench]'): no PNG"
    plot(result, png_path)
    return [json_path, md_path, png_path], None


def calibrate(result: dict[str, Any], directory: Path) -> Path:
    """Save the run as the calibration of its model on this machine, where the daemon's replay.calibrations
    finds it (the machine id is the daemon's: hostname and the CUDA device replay runs on, or cpu)."""
    return Calibration.from_json(public(result), "<this run>").save(directory)


def check_markdown(calibration_file: Path, result: dict[str, Any], floor: FidelityFloor,
                   budgets: Sequence[int]) -> str:
    """This run against a calibration made by another (the issue's targets): how far the calibrated model's
    predictions are from what this run measured, and whether the option it chooses is within 20% of the
    fastest option this run measured among those the budget and the floor allow."""
    cal = Calibration.from_file(calibration_file)
    acc = [a for a in report(cal, public(result)) if math.isfinite(a.ratio)]
    lines = [f"## Against the calibration {calibration_file}", "",
             "| what | measured ms | predicted ms | predicted / measured |", "|---|---:|---:|---:|"]
    lines += [f"| {a.what} | {a.measured * 1e3:.3f} | {a.predicted * 1e3:.3f} | {a.ratio:.2f} |" for a in acc]
    for kind in ("replay", "load"):
        errs = [abs(a.ratio - 1) for a in acc if a.what.startswith(kind)]
        if errs:
            lines.append(f"\n{kind}: predicted within {100 * max(errs):.1f}% (worst), "
                         f"{100 * statistics.median(errs):.1f}% (median) of {len(errs)} points")
    rows = policy_check(cal, public(result), budgets, floor)
    lines += ["", f"Policy (floor: top-1 >= {floor.min_top1}, KL <= {floor.max_kl}):", "",
              "| context | budget | chosen | its measured ms | best allowed | its ms | ratio |",
              "|---:|---:|---|---:|---|---:|---:|"]
    lines += [f"| {r.context} | {'none' if not r.budget_bytes else 'ample' if r.budget_bytes >= 1 << 40 else _mib(r.budget_bytes)} | {r.chosen} | {r.chosen_s * 1e3:.3f} | {r.best} | "
              f"{r.best_s * 1e3:.3f} | {r.ratio:.2f} |" for r in rows]
    worst = max((r.ratio for r in rows), default=math.nan)
    lines.append(f"\nworst chosen / best: {worst:.2f} (target <= 1.20)")
    return "\n".join(lines) + "\n"
