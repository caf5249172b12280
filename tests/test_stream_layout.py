"""Stream layouts (engram/layout.py) and block format v2 (engram/codec/streamformat.py), without a daemon: the
K/V layout and its v1 blocks exactly as they were (fingerprints and bytes pinned), stream layouts' identity,
their checks, the presets' real shapes round-tripping in every codec (bit-exact raw, within each codec's stated
error otherwise), and v2 blocks that are damaged being refused."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import xxhash

from engram.codec import stored, streamformat
from engram.errors import InvalidArgument
from engram.layout import Axis, DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.presets import PRESETS, bytes_per_token
from engram.wire import convert

from helpers import tiny_layout

# Relative RMS error on Gaussian data the codecs state (docs/FP4_NOTES.md: 0.095, 0.115, 0.026), with room for
# small samples.
STATED_ERROR = {"nvfp4": 0.105, "mxfp4": 0.125, "fp8_e4m3": 0.030}
CODECS = ["raw", "fp8_e4m3", "nvfp4", "mxfp4"]


def mla_layout(block_tokens: int = 16, **stream: object) -> KVLayout:
    latent = StreamSpec("latent", (576,), DType.BF16, **stream)  # type: ignore[arg-type]
    return KVLayout((LayerSpec(LayerKind.SLIDING, 8), LayerSpec(LayerKind.GLOBAL)) * 2, block_tokens=block_tokens,
                    streams=(latent, StreamSpec("index_k", (128,), DType.BF16, "fp8_e4m3")),
                    window_streams=(StreamSpec("k", (1, 64)), StreamSpec("v", (1, 64))))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


# ---- the K/V layout is what it was -------------------------------------------------------------------------


def test_kv_layout_identity_and_v1_bytes_are_unchanged() -> None:
    # Computed by the code before stream layouts existed: a change here re-keys every stored block.
    assert tiny_layout().canonical() == b"dtype=BF16;kvh=2;hd=16;bt=16;SLIDING:8;GLOBAL:0;SLIDING:8;GLOBAL:0"
    lay = tiny_layout()
    assert ModelSpec("tiny-hybrid", "seed-0", lay, "raw").fingerprint.hex() == "0e1ee5f8cd79e0765595480769eea95e"
    assert ModelSpec("tiny-hybrid", "seed-0", lay, "nvfp4").fingerprint.hex() == "aa191752be0970e574ab8a626e20c0fc"
    big = KVLayout((LayerSpec(LayerKind.SLIDING, 128), LayerSpec(LayerKind.GLOBAL)) * 12, 8, 64)
    assert ModelSpec("m", "w", big, "").fingerprint.hex() == "8e30f306d8a623322d6888e0eb9882d0"
    kv = (torch.arange(2 * 2 * 16 * 2 * 16, dtype=torch.float32).reshape(2, 2, 16, 2, 16).sin() * 3).to(torch.bfloat16)
    pinned = {"raw": (4096, "e9637f860c2a9236"), "nvfp4": (1216, "cdde285336d23f1e"),
              "mxfp4": (2232, "c65489d89f6a9409"), "fp8_e4m3": (2112, "918c179c4f51f037")}
    for codec, (n, digest) in pinned.items():
        blob = stored.encode(kv, codec)  # a raw block, or a v1 block, as blocks on disk were written
        assert (len(blob), xxhash.xxh3_64_hexdigest(blob)) == (n, digest), codec
        back = stored.decode(blob, codec, DType.BF16, lay.block_shape(16))
        if codec == "raw":
            assert torch.equal(back, kv)
        else:
            assert rel_rms(back, kv) < STATED_ERROR[codec]
    assert not lay.has_streams and lay.stream_specs == (StreamSpec("k", (2, 16), axis=Axis.CHANNEL),
                                                         StreamSpec("v", (2, 16), axis=Axis.TOKEN))
    assert ModelSpec("m", "w", lay, "nvfp4").stored_codec == "nvfp4"


def test_a_v1_block_is_not_taken_for_a_v2_block_nor_the_reverse() -> None:
    kv = torch.randn(2, 2, 16, 2, 16).bfloat16()
    with pytest.raises(InvalidArgument, match="version 1"):
        streamformat.parse(stored.encode(kv, "nvfp4"))
    lay = mla_layout()
    blob = stored.encode_streams({s.name: torch.randn(lay.stream_shape(s, 16)).bfloat16() for s in lay.streams},
                                 lay.resolved_streams("raw"), 16)
    with pytest.raises(InvalidArgument, match="version 2"):
        stored.decode(blob, "nvfp4", DType.BF16, (2, 2, 16, 2, 16))
    with pytest.raises(InvalidArgument, match="decode_block"):
        stored.decode(blob, "streams", DType.BF16, lay.block_shape(16))


# ---- stream layouts: identity and checks ------------------------------------------------------------


def test_a_stream_layouts_fingerprint_covers_its_streams() -> None:
    base = ModelSpec("m", "w", mla_layout(), "nvfp4")
    assert base.fingerprint == ModelSpec("m", "w", mla_layout(), "nvfp4").fingerprint
    assert b"streams=latent:576:BF16::TOKEN:1|index_k:128:BF16:fp8_e4m3:TOKEN:1" in base.layout.canonical()
    variants = [mla_layout(codec="raw"), mla_layout(axis=Axis.CHANNEL), mla_layout(compress=4),
                dataclasses.replace(mla_layout(), streams=(StreamSpec("latent", (512,)),)),
                dataclasses.replace(mla_layout(), streams=(StreamSpec("latent", (576,), DType.FP16),)),
                dataclasses.replace(mla_layout(), window_streams=(StreamSpec("kv", (1, 64)),)),
                dataclasses.replace(mla_layout(), layers=(LayerSpec(LayerKind.GLOBAL), LayerSpec(LayerKind.REINDEX),
                                                          LayerSpec(LayerKind.REUSE, 8)))]
    prints = {ModelSpec("m", "w", v, "nvfp4").fingerprint for v in variants} | {base.fingerprint}
    assert len(prints) == len(variants) + 1
    assert base.stored_codec == "streams"
    assert [s.codec for s in base.streams] == ["nvfp4", "fp8_e4m3"]  # "" resolved to the model's codec


@pytest.mark.parametrize(("make", "match"), [
    (lambda: StreamSpec("Latent", (576,)), "stream name"),
    (lambda: StreamSpec("a_name_too_long", (576,)), "stream name"),
    (lambda: StreamSpec("abcdefgh\n", (576,)), "stream name"),  # 9 bytes: a v2 record holds 8 ("$" let it by)
    (lambda: StreamSpec("x", (2, 3, 4, 5)), "1-3 dimensions"),
    (lambda: StreamSpec("x", (0,)), "1-3 dimensions"),
    (lambda: StreamSpec("x", (8,), compress=3), "power of two"),
    (lambda: StreamSpec("x", (4096, 1025)), "elements per entry must be in"),  # limits.py: the K/V layout's bound
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL),), block_tokens=1 << 17, streams=(StreamSpec("x", (8,)),)),
     "power of two in"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL),) * 1025, streams=(StreamSpec("x", (8,)),)), "number of layers"),
    (lambda: LayerSpec(LayerKind.GLOBAL, (1 << 20) + 1), "exceeds the bound"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL),), streams=(StreamSpec("x", (8,)), StreamSpec("x", (4,)))),
     "repeat"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL),), block_tokens=16, streams=(StreamSpec("x", (8,), compress=32),)),
     "exceeds block_tokens"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL),), 8, 64, streams=(StreamSpec("x", (8,)),)), "leave num_kv_heads"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL, 8),), 8, 64), "a sliding branch beside global attention"),
    (lambda: KVLayout((LayerSpec(LayerKind.GLOBAL, 8),), streams=(StreamSpec("x", (8,)),)), "window_streams"),
    (lambda: KVLayout((LayerSpec(LayerKind.REUSE),), streams=(StreamSpec("x", (8,)),)), "no global layer"),
    (lambda: LayerSpec(LayerKind.SHARED, 4), "has no window"),
])
def test_bad_stream_layouts_say_what_to_change(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument, match=match):
        make()


def test_a_stream_layout_survives_the_wire_and_the_model_file() -> None:
    for lay in (mla_layout(), PRESETS["csa2"].layout, tiny_layout()):
        spec = ModelSpec("m", "w", lay, "nvfp4")
        assert convert.model_from_pb(convert.model_to_pb(spec)) == spec
        assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert "streams" not in ModelSpec("m", "w", tiny_layout()).to_dict()["layout"]  # type: ignore[operator]


def test_stream_sizes_count_entries_and_layers() -> None:
    lay = PRESETS["csa2"].layout
    latent = lay.streams[0]
    assert lay.persisted_layers == 10 and lay.windowed_layers == 61
    assert lay.stream_shape(latent, 256) == (10, 64, 512) and latent.entries(7) == 1
    assert lay.block_shape(256) == (10, 2, 256)
    assert lay.bytes_per_token() == 10 * (512 + 128) * 2 // 4
    assert lay.all_layers_bytes_per_token() == lay.bytes_per_token() + 61 * 512 * 2


# ---- presets: real shapes, every codec -----------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_in_every_codec(name: str, codec: str) -> None:
    preset = PRESETS[name]
    lay = dataclasses.replace(preset.layout, block_tokens=16)  # real widths and depths, short blocks
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{codec}".encode()))
    for n in (16, 7):  # a full block and a partial one
        if lay.has_streams:
            streams = tuple(dataclasses.replace(s, codec=codec) for s in lay.streams)
            data = {s.name: torch.randn(lay.stream_shape(s, n), generator=gen).bfloat16() for s in streams}
            blob = stored.encode_streams(data, streams, n)
            assert len(blob) == stored.stored_nbytes("streams", lay.block_shape(n), lay.dtype, streams)
            back = stored.decode_block(blob, "streams", lay.dtype, lay.block_shape(n))
            assert isinstance(back, dict) and set(back) == set(data)
            pairs = [(back[k], data[k]) for k in data]
        else:
            kv = torch.randn(lay.block_shape(n), generator=gen).bfloat16()
            blob = stored.encode(kv, codec)
            assert len(blob) == stored.stored_nbytes(codec, lay.block_shape(n), lay.dtype)
            pairs = [(stored.decode(blob, codec, lay.dtype, lay.block_shape(n)), kv)]
        for got, want in pairs:
            assert got.shape == want.shape and got.dtype == want.dtype
            if codec == "raw":
                assert torch.equal(got, want)
            elif want.numel():
                assert rel_rms(got, want) < STATED_ERROR[codec], (name, codec, n)


def test_each_stream_keeps_its_own_codec() -> None:
    preset = PRESETS["deepseek-v3.2"]
    lay = dataclasses.replace(preset.layout, block_tokens=16)
    streams = lay.resolved_streams("raw")  # the latent raw (exact), the indexer keys FP8
    data = {s.name: torch.randn(lay.stream_shape(s, 16)).bfloat16() for s in streams}
    back = stored.decode_block(stored.encode_streams(data, streams, 16), "streams", lay.dtype, lay.block_shape(16))
    assert isinstance(back, dict)
    assert torch.equal(back["latent"], data["latent"])
    assert 0 < rel_rms(back["index_k"], data["index_k"]) < STATED_ERROR["fp8_e4m3"]


def test_the_seed_like_preset_lands_near_the_reports_890_bytes_per_token() -> None:
    csa2 = bytes_per_token(PRESETS["csa2"])
    assert 850 <= csa2.persisted <= 950
    assert csa2.all_layers > 30 * csa2.persisted  # the window KV of 61 layers is most of a no-replay cache
    v3 = bytes_per_token(PRESETS["deepseek-v3"], "raw")
    assert v3.persisted == pytest.approx(61 * 576 * 2, rel=1e-3)
    llama = bytes_per_token(PRESETS["llama-3-8b"], "raw")
    assert llama.persisted == 32 * 2 * 8 * 128 * 2 == llama.all_layers
    gemma = bytes_per_token(PRESETS["gemma-3-27b"], "nvfp4")
    assert gemma.all_layers / gemma.persisted == pytest.approx(6.2, rel=0.01)  # 62 layers, 10 of them global


# ---- v2 blocks: damage is refused ---------------------------------------------------------------------------


def _v2_block() -> tuple[bytes, streamformat.StreamsFormat]:
    lay = mla_layout()
    streams = lay.resolved_streams("nvfp4")
    blob = stored.encode_streams({s.name: torch.randn(lay.stream_shape(s, 16)).bfloat16() for s in streams},
                                 streams, 16)
    return blob, streamformat.parse(blob)


@pytest.mark.parametrize(("where", "match"), [
    (0, "bad magic"), (4, "version"), (5, "does not fit|checksum"), (40, "header checksum"),
    (-1, "body checksum"),
])
def test_a_damaged_v2_block_is_refused_saying_where(where: int, match: str) -> None:
    blob, fmt = _v2_block()
    broken = bytearray(blob)
    broken[where] ^= 0x5A
    with pytest.raises(InvalidArgument, match=match):
        streamformat.decode(bytes(broken))


def test_a_v2_block_of_the_wrong_length_or_streams_is_refused() -> None:
    blob, fmt = _v2_block()
    with pytest.raises(InvalidArgument, match="describes a block of"):
        streamformat.parse(blob[:-1])
    assert all(p.at % streamformat.ALIGN == 0 for p in fmt.parts)
    lay = mla_layout()
    other = dataclasses.replace(lay, streams=(StreamSpec("latent", (512,)), lay.streams[1]))
    with pytest.raises(InvalidArgument, match="stream latent"):
        stored.stored_streams(blob, other.resolved_streams("nvfp4"), lay.block_shape(16))
    with pytest.raises(InvalidArgument, match="streams"):
        streamformat.encode({"latent": torch.zeros(2, 16, 576).bfloat16()}, lay.resolved_streams("raw"), 16)
    with pytest.raises(InvalidArgument, match="index_k"):
        streamformat.encode({"latent": torch.zeros(2, 16, 576).bfloat16(), "index_k": torch.zeros(2, 15, 128).bfloat16()},
                            lay.resolved_streams("raw"), 16)


def test_a_raw_put_is_encoded_as_stored_and_an_encoded_one_kept() -> None:
    lay = mla_layout()
    spec = ModelSpec("m", "w", lay, "nvfp4")
    data = {s.name: torch.randn(lay.stream_shape(s, 16)).bfloat16() for s in lay.streams}
    raw = stored.encode_streams(data, streamformat.raw_streams(spec.streams), 16)
    as_stored = stored.encode_streams(data, spec.streams, 16)
    assert stored.stored_streams(raw, spec.streams, lay.block_shape(16)) == as_stored
    assert stored.stored_streams(as_stored, spec.streams, lay.block_shape(16)) == as_stored
    mx = stored.encode_streams(data, tuple(dataclasses.replace(s, codec="mxfp4") for s in spec.streams), 16)
    with pytest.raises(InvalidArgument, match="stores it as nvfp4"):
        stored.stored_streams(mx, spec.streams, lay.block_shape(16))
    # and back to raw for a Get that asks the daemon to decode
    back = stored.decode_block(stored.as_raw(as_stored, "streams", lay.dtype, lay.block_shape(16)), "streams",
                               lay.dtype, lay.block_shape(16))
    want = stored.decode_block(as_stored, "streams", lay.dtype, lay.block_shape(16))
    assert isinstance(back, dict) and isinstance(want, dict)
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_engram_layouts_lists_every_preset_with_its_bytes_per_token() -> None:
    """`engram layouts --json` is presets.table(): every preset, priced in every codec and in its own; the table
    form names each of them."""
    import json

    from typer.testing import CliRunner

    from engram.cli.main import app

    result = CliRunner().invoke(app, ["layouts", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert list(rows) == list(PRESETS)
    for name, row in rows.items():
        costs = row["bytes_per_token"]
        assert set(costs) == {"raw", "fp8_e4m3", "nvfp4", "mxfp4", "preset"}, name
        assert costs["nvfp4"]["persisted"] == round(bytes_per_token(PRESETS[name], "nvfp4").persisted, 2)
        assert costs["nvfp4"]["persisted"] < costs["fp8_e4m3"]["persisted"] < costs["raw"]["persisted"]
        assert all(c["persisted"] <= c["all_layers"] for c in costs.values())
    raw = rows["deepseek-v3"]["bytes_per_token"]["raw"]["persisted"]
    assert 61 * 576 * 2 < raw < 61 * 576 * 2 + 1  # a v2 block even raw: its header is 0.31 bytes a token
    assert round(rows["csa2"]["bytes_per_token"]["nvfp4"]["persisted"]) == 901
    table = CliRunner().invoke(app, ["layouts"])
    assert table.exit_code == 0 and all(name in table.output for name in PRESETS)


@pytest.mark.parametrize("shape", [(1,), (1, 1), (4, 1), (2, 3, 1), (4, 2)])
def test_a_stream_whose_entries_end_in_width_one_decodes_to_raw_on_the_daemon(shape: tuple[int, ...]) -> None:
    """as_raw (what a decode_on_server Get answers) of a quantized stream grouped along its channels whose entry
    shape ends in 1: the decoded view counted as contiguous to torch but kept a stride other than 1 in that
    dimension, and view(uint8) raised (INTERNAL on gRPC, the data channel closed). Its raw bytes now equal the
    client-side decode's."""
    streams = (StreamSpec("lat", shape, DType.BF16, "nvfp4", Axis.CHANNEL),)
    data = {"lat": torch.randn(1, 16, *shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    blob = streamformat.encode(data, streams, 16)
    raw = stored.as_raw(blob, stored.STREAMS, DType.BF16, (1, 1, 16))
    decoded = stored.decode_block(blob, stored.STREAMS, DType.BF16, (1, 1, 16))["lat"]
    again = stored.decode_block(raw, stored.STREAMS, DType.BF16, (1, 1, 16))["lat"]
    assert torch.equal(again, decoded)
