"""The paged-write kernel (engram/kernels/paged.py) against the torch path (engram.destinations._write_pages) on
the same runs: vLLM's FlashAttention layout (contiguous pages), its standardized view (K and V interleaved in a
row: strided entries), an MLA latent (one vector an entry), pages smaller than blocks, runs that start past the
first page or end inside one, strided runs (the loader's K out of (blocks, L, 2, bt, H, D)), and a run that
straddles the first token a vLLM load writes (FromToken). Every case compares every page of every layer, so
a write to the wrong page, row, layer or element, or a write outside the request's pages, fails it.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 before the kernels are imported, as in
tests/test_fp4_kernels.py; where this process compiled them instead, test_cpu_tests_in_subprocess runs the CPU
tests in a fresh process). The GPU test checks PagedKV.write (PagedStreamsKV.write for the latent) takes the
kernel on CUDA and writes what the torch path writes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import missing

if importlib.util.find_spec("triton") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("triton", "the kernels' tests need it (pip install -e '.[dev]' or '.[kernels]')")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engram import destinations
from engram.destinations import PagedKV, PagedStreamsKV, _write_pages
from engram.errors import InvalidArgument
from engram.integrations.vllm.paged import FromToken, kv_pages, latent_pages
from engram.kernels import paged
from engram.layout import DType, StreamSpec

cpu = pytest.mark.skipif(not paged.INTERPRETED, reason="kernels are compiled in this process; "
                         "test_cpu_tests_in_subprocess runs the CPU tests in interpreter mode")

LAYERS, HEADS, DIM = 3, 2, 8


def caches(layout: str, num_pages: int, pt: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """Per layer, a vLLM cache tensor filled with noise (so untouched elements are checked too)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"flash": (2, num_pages, pt, HEADS, DIM), "standardized": (num_pages, HEADS, pt, 2 * DIM),
             "mla": (num_pages, pt, 4 * DIM)}[layout]
    return [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(LAYERS)]


def pages_of(layout: str, cache: torch.Tensor) -> list[torch.Tensor]:
    """The streams' pages of one layer's cache: [K, V], or [latent]."""
    if layout == "mla":
        return [latent_pages(cache, 4 * DIM)]
    return list(kv_pages(cache, HEADS, DIM))


def run_data(layout: str, blocks: int, bt: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """What the loader hands a destination per stream: K and V as strided views of one (blocks, L, 2, bt, H, D)
    run, or the latent (blocks, L, bt, 4D)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "mla":
        return [torch.randn(blocks, LAYERS, bt, 4 * DIM, generator=g).to(dtype).to(device)]
    kv = torch.randn(blocks, LAYERS, 2, bt, HEADS, DIM, generator=g).to(dtype).to(device)
    return [kv[:, :, 0], kv[:, :, 1]]


def write_both_ways(layout: str, pt: int, bt: int, blocks: int, start: int, n_tokens: int, table: list[int],
                    dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The caches after the kernel's write and after the torch path's, from the same starting contents."""
    kernel = caches(layout, 16, pt, dtype, device, seed)
    torch_ = [c.clone() for c in kernel]
    t = torch.tensor(table, dtype=torch.int64, device=device)
    for stream, data in enumerate(run_data(layout, blocks, bt, dtype, device, seed + 1)):
        k_layers = [pages_of(layout, c)[stream] for c in kernel]
        offsets = paged.layer_offsets(k_layers)
        assert offsets is not None
        assert paged.write_pages(k_layers, offsets, t, pt, data, start, n_tokens)
        _write_pages([pages_of(layout, c)[stream] for c in torch_], t, pt, data, start, n_tokens)
    return kernel, torch_


def assert_same(kernel: list[torch.Tensor], torch_: list[torch.Tensor]) -> None:
    for layer, (a, b) in enumerate(zip(kernel, torch_, strict=True)):
        same = a.view(torch.uint8) if a.element_size() == 1 else a.flatten().view(torch.int16 if a.element_size() == 2
                                                                                   else torch.int32)
        other = b.flatten().view(same.dtype)
        bad = (same != other).nonzero()
        assert bad.numel() == 0, f"layer {layer}: {bad.numel()} elements differ, first at flat index {bad[:4].tolist()}"


@cpu
@pytest.mark.parametrize("layout", ["flash", "standardized", "mla"])
def test_whole_pages_match_torch_path(layout: str) -> None:
    # 2 blocks of 8 tokens into pages of 4 through a scrambled table, every entry written
    kernel, torch_ = write_both_ways(layout, pt=4, bt=8, blocks=2, start=0, n_tokens=16, table=[9, 2, 14, 5, 0])
    assert_same(kernel, torch_)
    assert not torch.equal(kernel[0], caches(layout, 16, 4, torch.bfloat16, "cpu", 0)[0])  # it wrote something


@cpu
@pytest.mark.parametrize("layout", ["flash", "standardized", "mla"])
def test_run_past_the_first_page_ending_inside_a_page_matches_torch_path(layout: str) -> None:
    # a run at token 8 (page 2 of the table) of 3 blocks whose last 5 tokens are not wanted: a partial last page
    kernel, torch_ = write_both_ways(layout, pt=4, bt=8, blocks=3, start=8, n_tokens=19,
                                     table=[3, 11, 7, 1, 12, 6, 15, 4])
    assert_same(kernel, torch_)


@cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_match_torch_path(dtype: torch.dtype) -> None:
    kernel, torch_ = write_both_ways("flash", pt=8, bt=8, blocks=2, start=0, n_tokens=13, table=[4, 10], dtype=dtype)
    assert_same(kernel, torch_)


@cpu
def test_a_load_that_starts_inside_a_run_writes_only_from_there() -> None:
    # FromToken: vLLM computed the first 4 tokens itself; the run covers tokens 0-15, the load writes 4-14
    kernel = caches("flash", 16, 4, torch.bfloat16, "cpu", 3)
    torch_ = [c.clone() for c in kernel]
    table = [8, 1, 13, 6]
    data = run_data("flash", 2, 8, torch.bfloat16, "cpu", 4)
    for target in (kernel, torch_):
        k, v = zip(*(kv_pages(c, HEADS, DIM) for c in target), strict=True)
        dest = FromToken(PagedKV(list(k), list(v), table), first=4)
        if target is kernel:  # force the kernel on CPU tensors (PagedKV takes it on CUDA only)
            dest.inner._offsets = {s: paged.layer_offsets(dest.inner.streams[s]) for s in (0, 1)}
        dest.write(0, data[0], 0, 15)
        dest.write(1, data[1], 0, 15)
    assert_same(kernel, torch_)
    untouched = caches("flash", 16, 4, torch.bfloat16, "cpu", 3)
    assert torch.equal(kernel[0][:, 8], untouched[0][:, 8])  # page 8 holds tokens 0-3: vLLM's, left alone


def test_layers_it_cannot_address_go_to_the_torch_path() -> None:
    pages = [torch.zeros(4, 4, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    other_strides = [*pages[:2], torch.zeros(4, HEADS, 4, DIM, dtype=torch.bfloat16).transpose(1, 2)]
    other_dtype = [*pages[:2], pages[2].float()]
    assert paged.layer_offsets(other_strides) is None
    assert paged.layer_offsets(other_dtype) is None
    assert paged.layer_offsets([p.to(torch.int32) for p in pages]) is None
    if not paged.INTERPRETED:  # compiled kernels: CPU pages are the torch path's
        assert paged.layer_offsets(pages) is None


@cpu
def test_bad_runs_are_refused_before_anything_is_written() -> None:
    layers = [p[0] for p in caches("flash", 16, 4, torch.bfloat16, "cpu", 5)]
    before = [p.clone() for p in layers]
    offsets = paged.layer_offsets(layers)
    assert offsets is not None
    data = run_data("flash", 2, 8, torch.bfloat16, "cpu", 6)[0]
    table = torch.tensor([1, 2, 3], dtype=torch.int64)  # 3 pages: 12 tokens
    with pytest.raises(InvalidArgument, match="block table has 3"):
        paged.write_pages(layers, offsets, table, 4, data, 0, 16)
    with pytest.raises(InvalidArgument, match="must divide"):
        paged.write_pages(layers, offsets, table, 4, data, 2, 8)
    with pytest.raises(InvalidArgument, match="cannot supply"):
        paged.write_pages(layers, offsets, table, 4, data, 0, 17)
    with pytest.raises(InvalidArgument, match="layers"):
        paged.write_pages(layers[:2], offsets[:2], table, 4, data, 0, 8)
    assert not paged.write_pages(layers, offsets, table, 4, data.float(), 0, 8)  # another dtype: torch path
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


def test_cpu_tests_in_subprocess() -> None:
    if paged.INTERPRETED:
        pytest.skip("this process runs the CPU tests itself (interpreted kernels)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           "-k", "not test_cpu_tests_in_subprocess"]
    run = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: run on a GPU")
@pytest.mark.skipif(paged.INTERPRETED, reason="TRITON_INTERPRET is set: GPU tests need compiled kernels")
@pytest.mark.parametrize("layout", ["flash", "standardized", "mla"])
def test_gpu_paged_write_takes_the_kernel_and_matches_torch_path(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(destinations, "PAGED_KERNEL", True)
    pt, bt, blocks = 16, 256, 3
    table = torch.randperm(64)[:48].tolist()
    g_caches = [c for c in caches(layout, 64, pt, torch.bfloat16, "cuda", 7)]
    ref = [c.clone() for c in g_caches]
    streams = [list(layers) for layers in zip(*(pages_of(layout, c) for c in g_caches), strict=True)]
    dest: PagedKV | PagedStreamsKV
    if layout == "mla":
        spec = StreamSpec("latent", (4 * DIM,), DType.BF16)
        dest = PagedStreamsKV([spec], {"latent": streams[0]}, table)
    else:
        dest = PagedKV(streams[0], streams[1], table)
    data = run_data(layout, blocks, bt, torch.bfloat16, "cuda", 8)
    n = blocks * bt - 37
    for stream, d in enumerate(data):
        dest.write(stream, d, 0, n)
        assert dest._kernel_offsets(stream) is not None  # the kernel wrote
    t = torch.tensor(table, dtype=torch.int64, device="cuda")
    for stream, d in enumerate(data):
        _write_pages([pages_of(layout, c)[stream] for c in ref], t, pt, d, 0, n)
    torch.cuda.synchronize()
    assert_same(g_caches, ref)
