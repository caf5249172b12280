from __future__ import annotations

import re
from pathlib import Path

import pytest

from engram.config import config_keys, load_config, parse_bytes
from engram.errors import ConfigError, InvalidArgument
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

from helpers import tiny_layout


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "engram.toml"
    f.write_text('[server]\nport = 6000\nhost = "0.0.0.0"\n[tiers.dram]\ncapacity = "2GiB"\n')
    cfg = load_config(f, env={})
    assert (cfg.server.port, cfg.server.host, cfg.tiers.dram.capacity) == (6000, "0.0.0.0", 2 * 2**30)
    cfg = load_config(f, env={"ENGRAM_SERVER__PORT": "7000"})
    assert cfg.server.port == 7000 and cfg.server.host == "0.0.0.0"
    cfg = load_config(f, env={"ENGRAM_SERVER__PORT": "7000"}, overrides={"server.port": 8000})
    assert cfg.server.port == 8000
    cfg = load_config(env={"ENGRAM_CONFIG": str(f)})
    assert cfg.server.port == 6000
    assert load_config(env={}).server.port == 50051


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"file": "[server]\nprot = 1\n"}, "unknown config key 'server.prot'"),
        ({"file": "[nope]\nx = 1\n"}, "unknown config key 'nope.x'"),
        ({"file": "server = 3\n"}, "is a section"),
        ({"env": {"ENGRAM_TIERS__DRAM__CAPACTY": "1"}}, "ENGRAM_TIERS__DRAM__CAPACTY"),
        ({"env": {"ENGRAM_SERVER__PORT": "eighty"}}, "expected int"),
        ({"overrides": {"server.port": 70000}}, "0..65535"),
        ({"overrides": {"tiers.dram.capacity": "lots"}}, "not a byte size"),
        ({"overrides": {"server.chunk_bytes": "128MiB"}}, "chunk_bytes"),
        ({"file": "[server\n"}, "not valid TOML"),
        ({"overrides": {"tiers.eviction": "arc"}}, "tiers.eviction must be learned or lru"),
        # NaN passed every `< 0` check: shutdown_flush_s = nan skipped the write-back flush on SIGTERM
        ({"overrides": {"tiers.shutdown_flush_s": "nan"}}, "got NaN"),
        ({"env": {"ENGRAM_SERVER__LEASE_S": "NaN"}}, "got NaN"),
        ({"overrides": {"server.shutdown_grace_s": -1}}, "shutdown_grace_s"),
        ({"overrides": {"server.max_concurrent_rpcs": 0}}, "max_concurrent_rpcs must be positive"),
        ({"overrides": {"server.max_tokens_per_request": 0}}, "max_tokens_per_request must be positive"),
        ({"overrides": {"server.max_message_bytes": "2GiB"}}, "int32"),
        ({"file": b"\xff\xfe not utf-8"}, "not valid TOML"),
        ({"file": None}, "cannot be read"),  # a directory given as the file
        # a bad port or database in the Redis URL, or an endless TTL, failed with a traceback once serving
        ({"overrides": {"cluster.redis_url": "redis://127.0.0.1:notaport/0", "cluster.secret": "s"}}, "notaport"),
        ({"overrides": {"cluster.redis_url": "redis://127.0.0.1:6379/abc", "cluster.secret": "s"}}, "is a number"),
        ({"overrides": {"cluster.redis_url": "redis://127.0.0.1:6379", "cluster.secret": "s", "cluster.ttl_s": "inf"}},
         "finite"),
        ({"overrides": {"replay.max_concurrent": 0}}, "max_concurrent must be >= 1"),
        ({"overrides": {"replay.max_queued_per_tenant": -1}}, r"replay\.max_queued_per_tenant must be >= 0"),
        ({"overrides": {"replay.max_persisted_window_bytes_per_tenant": -1}},
         r"replay\.max_persisted_window_bytes_per_tenant must be >= 0"),
        # in-place reservations' share of the shared pool: a fraction of it, one tenant's no more than all's
        ({"overrides": {"server.max_reserved_pool_fraction": 0}}, r"max_reserved_pool_fraction must be a fraction .* \(0, 1\]"),
        ({"overrides": {"server.max_reserved_pool_fraction": 1.5}}, r"max_reserved_pool_fraction must be a fraction"),
        ({"overrides": {"server.max_reserved_pool_fraction_per_tenant": -0.1}},
         r"max_reserved_pool_fraction_per_tenant must be a fraction"),
        ({"overrides": {"server.max_reserved_pool_fraction": 0.4}},  # under the per-tenant default, 0.5
         r"max_reserved_pool_fraction_per_tenant must be at most server\.max_reserved_pool_fraction \(0\.4\)"),
        # a tenant's share of pinned bytes: a fraction of the largest tier
        ({"overrides": {"server.max_pinned_fraction_per_tenant": 0}},
         r"max_pinned_fraction_per_tenant must be a fraction of the largest tier in \(0, 1\]"),
        ({"overrides": {"server.max_pinned_fraction_per_tenant": 1.01}}, r"max_pinned_fraction_per_tenant must be"),
    ],
)
def test_bad_config_is_an_error(tmp_path: Path, source: dict, match: str) -> None:  # type: ignore[type-arg]
    path = None
    if "file" in source:
        path = tmp_path / "c.toml"
        if source["file"] is None:
            path.mkdir()
        elif isinstance(source["file"], bytes):
            path.write_bytes(source["file"])
        else:
            path.write_text(source["file"])
    with pytest.raises(ConfigError, match=match):
        load_config(path, env=source.get("env", {}), overrides=source.get("overrides"))


def test_a_bad_value_from_the_environment_names_its_variable(tmp_path: Path) -> None:
    """A range error named the key (server.stream_stall_s) but not that its value came from ENGRAM_*, where no
    config file shows it; type and range errors alike now lead with NAME=value, a secret's value redacted. A
    value from the file, or a variable a flag overrides, is not blamed on the environment."""
    def error(env: dict[str, str], overrides: dict[str, object] | None = None, path: Path | None = None) -> str:
        with pytest.raises(ConfigError) as caught:
            load_config(path, env=env, overrides=overrides)
        return str(caught.value)

    assert error({"ENGRAM_SERVER__STREAM_STALL_S": "-1"}).startswith(
        "ENGRAM_SERVER__STREAM_STALL_S=-1: server.stream_stall_s must be")
    assert error({"ENGRAM_SERVER__PORT": "eighty"}).startswith("ENGRAM_SERVER__PORT=eighty: server.port: expected int")
    assert error({"ENGRAM_CLUSTER__TTL_S": "1"}, {"cluster.redis_url": "redis://h:6379", "cluster.secret": "s"}
                 ).startswith("ENGRAM_CLUSTER__TTL_S=1: cluster.ttl_s (1.0) must exceed")
    url = error({"ENGRAM_CLUSTER__REDIS_URL": "redis://u:pw-s3cr3t@h:nope/0", "ENGRAM_CLUSTER__SECRET": "s"})
    assert url.startswith("ENGRAM_CLUSTER__REDIS_URL=redis://u:redacted:@h:nope/0: ") and "s3cr3t" not in url
    f = tmp_path / "c.toml"
    f.write_text("[server]\nstream_stall_s = -1\n")
    assert error({"ENGRAM_SERVER__PORT": "7000"}, path=f).startswith("server.stream_stall_s must be")
    assert error({"ENGRAM_SERVER__STREAM_STALL_S": "5"}, {"server.stream_stall_s": -1}).startswith(
        "server.stream_stall_s must be")
    assert load_config(env={"ENGRAM_SERVER__PORT": "99999"}, overrides={"server.port": 7000}).server.port == 7000


def test_every_time_setting_refuses_an_endless_value() -> None:
    """inf passed every `> 0` and `>= 0` check: server.stream_stall_s = inf started a daemon that never cut a
    stalled stream, the cluster's timings were checked only with a Redis URL. Every key in seconds or
    milliseconds (a new one too) refuses it now, and 0 keeps its meaning where it has one."""
    times = [key for key in config_keys() if key.endswith(("_s", "_ms"))]
    assert len(times) >= 16, times
    for key in times:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be a finite number of"):
            load_config(env={}, overrides={key: "inf"})
    for key in ("server.session_idle_s", "server.shutdown_grace_s", "tiers.retry_s", "tiers.write_back_window_s",
                "tiers.shutdown_flush_s", "tiers.prefetch_lead_ms"):
        assert load_config(env={}, overrides={key: 0}) is not None


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml", env={})


def test_byte_sizes() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 MiB") == int(1.5 * 2**20)
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(123) == 123
    with pytest.raises(ConfigError):
        parse_bytes(True)


def test_config_keys_lists_every_leaf() -> None:
    keys = config_keys()
    assert "server.port" in keys and "tiers.dram.capacity" in keys and "logging.json" in keys
    assert not any(k.endswith(".dram") or k == "server" for k in keys)


def test_layout_sizes_and_validation() -> None:
    layout = tiny_layout()
    assert layout.persisted_layers == 2
    assert layout.block_shape(16) == (2, 2, 16, 2, 16)
    assert layout.block_nbytes(16) == 2 * 2 * 16 * 2 * 16 * 2
    with pytest.raises(InvalidArgument, match="power of two"):
        KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=8, block_tokens=48)
    with pytest.raises(InvalidArgument, match="no global layer"):
        KVLayout(layers=(LayerSpec(LayerKind.SLIDING, 8),), num_kv_heads=1, head_dim=8)
    with pytest.raises(InvalidArgument, match="window"):
        LayerSpec(LayerKind.SLIDING, 0)


def test_fingerprint_covers_weights_layout_and_codec() -> None:
    base = ModelSpec("m", "w1", tiny_layout())
    assert base.fingerprint == ModelSpec("m", "w1", tiny_layout()).fingerprint
    variants = [
        ModelSpec("m", "w2", tiny_layout()),
        ModelSpec("m2", "w1", tiny_layout()),
        ModelSpec("m", "w1", tiny_layout(DType.FP16)),
        ModelSpec("m", "w1", tiny_layout(block_tokens=32)),
        ModelSpec("m", "w1", tiny_layout(), codec="nvfp4"),
    ]
    assert len({v.fingerprint for v in variants} | {base.fingerprint}) == len(variants) + 1
