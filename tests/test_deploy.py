"""No Docker engine runs here: parse the Dockerfile, docker-compose.yml and deploy/prometheus.yml, and check
that every command, flag, port, config key and ENGRAM_* variable they use exists in the CLI and the config."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import typer.main
import yaml

from engram.cli.main import app
from engram.config import EngramConfig, config_keys, load_config, parse_bytes

REPO = Path(__file__).resolve().parent.parent


def check_command(argv: list[str]) -> None:
    """argv is `engram <command> [--flag value ...]` and every part exists in the Typer app."""
    assert argv[0] == "engram", argv
    command = typer.main.get_command(app).commands.get(argv[1])  # type: ignore[attr-defined]
    assert command is not None, f"engram has no command {argv[1]!r}"
    flags = {opt for p in command.params for opt in p.opts}
    for arg in argv[2:]:
        if arg.startswith("-"):
            assert arg.split("=")[0] in flags, f"engram {argv[1]} has no option {arg}"


def check_env(env: dict[str, str]) -> EngramConfig:
    keys = set(config_keys())
    for name in env:
        assert name.startswith("ENGRAM_"), name
        dotted = name.removeprefix("ENGRAM_").lower().replace("__", ".")
        assert dotted in keys, f"{name} names no config key ({dotted})"
    return load_config(env=env)  # and every value is valid


def dockerfile() -> tuple[str, dict[str, str], list[int], list[str], list[str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    base, env, expose, cmd, copies = "", {}, [], [], []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            base = rest.strip()
        elif word == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "EXPOSE":
            expose += [int(p) for p in rest.split()]
        elif word == "CMD":
            cmd = json.loads(rest)
        elif word == "COPY":
            copies += rest.split()[:-1]
        elif word == "RUN" and "torch" in rest:
            assert "torch==2.13.0" in rest and "/whl/cpu" in rest
    return base, env, expose, cmd, copies


def test_dockerfile() -> None:
    base, env, expose, cmd, copies = dockerfile()
    assert base == "python:3.11-slim"
    check_command(cmd)
    cfg = check_env(env)
    assert sorted(expose) == sorted([cfg.server.port, cfg.server.metrics_port])
    assert cfg.server.host == cfg.server.metrics_host == "0.0.0.0"
    for src in copies:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"


def test_compose_and_prometheus() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"engram", "redis", "prometheus"} <= set(services)
    engram = services["engram"]
    check_command(engram["command"])
    argv = engram["command"]
    port = int(argv[argv.index("--port") + 1])
    cfg = check_env({k: str(v) for k, v in engram["environment"].items()})
    assert cfg.server.metrics_port > 0 and cfg.server.metrics_host == "0.0.0.0"
    published = {int(p.split(":")[1]) for p in engram["ports"]}
    assert published == {port, cfg.server.metrics_port}
    mounts = [v.split(":")[1] for v in engram.get("volumes", [])]
    assert any(cfg.tiers.nvme.path.startswith(m) for m in mounts), "the NVMe tier must live on a volume"
    if cfg.tiers.dram.pool == "shared":  # the segment lives in /dev/shm: docker's default 64 MiB cannot hold it
        assert parse_bytes(engram["shm_size"]) > cfg.tiers.dram.capacity
    assert cfg.cluster.redis_url.startswith("redis://redis:") and cfg.cluster.advertise == f"engram:{port}"

    prom = services["prometheus"]
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    inside = config_arg.split("=", 1)[1]
    host_file = next(v.split(":")[0] for v in prom["volumes"] if v.split(":")[1] == inside)
    scrape = yaml.safe_load((REPO / host_file).read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"engram:{cfg.server.metrics_port}"]
    assert re.fullmatch(r"redis:\d+(\.\d+)*", services["redis"]["image"])
