"""No Docker engine runs here: parse the Dockerfile, docker-compose.yml and deploy/prometheus.yml, and check
that every command, flag, port, config key and ENGRAM_* variable they use exists in the CLI and the config."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

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


def dockerfile() -> dict[str, Any]:
    """base, env, expose, cmd, copies, user and healthcheck (its CMD) of the Dockerfile."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    d: dict[str, Any] = {"base": "", "env": {}, "expose": [], "cmd": [], "copies": [], "user": "root",
                         "healthcheck": None}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            d["base"] = rest.strip()
        elif word == "ENV":
            d["env"].update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "EXPOSE":
            d["expose"] += [int(p) for p in rest.split()]
        elif word == "CMD":
            d["cmd"] = json.loads(rest)
        elif word == "COPY":
            d["copies"] += rest.split()[:-1]
        elif word == "RUN" and "torch" in rest:
            assert "torch==2.13.0" in rest and "/whl/cpu" in rest
        elif word == "USER":
            d["user"] = rest.strip()
        elif word == "HEALTHCHECK":
            d["healthcheck"] = json.loads(rest.split(" CMD ", 1)[1])
    return d


def test_dockerfile() -> None:
    d = dockerfile()
    assert d["base"] == "python:3.11-slim"
    check_command(d["cmd"])
    cfg = check_env(d["env"])
    assert sorted(d["expose"]) == sorted([cfg.server.port, cfg.server.data_port, cfg.server.metrics_port])
    assert cfg.server.host == cfg.server.metrics_host == "0.0.0.0"
    for src in d["copies"]:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"
    assert d["user"] not in ("root", "0"), "the daemon must not run as root"
    health = d["healthcheck"]
    assert health is not None, "the image needs a HEALTHCHECK"
    check_command(health)
    assert health[1] == "ping" and health[health.index("--address") + 1] == f"127.0.0.1:{cfg.server.port}"


COMPOSE_VAR = re.compile(r"\$\{(\w+)(?::\?[^}]*)?\}")


def substitute(value: str, seen: set[str]) -> str:
    """What compose makes of `${VAR:?message}`: the variable's value (a stand-in here). Only the required
    form is allowed, so a missing secret stops compose instead of becoming an empty string."""
    assert ":-" not in value and "${" not in COMPOSE_VAR.sub("", value), f"use ${{VAR:?message}} in {value!r}"
    seen.update(COMPOSE_VAR.findall(value))
    return COMPOSE_VAR.sub(lambda m: f"stand-in-{m.group(1).lower()}", value)


def published(ports: list[str]) -> dict[int, str]:
    """container port -> the host address it is published on ("" = every interface)."""
    out = {}
    for spec in ports:
        parts = str(spec).split(":")
        host, container = (parts[0] if len(parts) == 3 else ""), int(parts[-1])
        out[container] = host
    return out


def test_compose_and_prometheus() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"engram", "redis", "prometheus"} <= set(services)
    engram = services["engram"]
    check_command(engram["command"])
    argv = engram["command"]
    port = int(argv[argv.index("--port") + 1])
    secrets: set[str] = set()
    env = {k: substitute(str(v), secrets) for k, v in engram["environment"].items()}
    cfg = check_env(env)
    assert cfg.server.metrics_port > 0 and cfg.server.metrics_host == "0.0.0.0"
    ports = published(engram["ports"])
    assert set(ports) == {port, cfg.server.data_port, cfg.server.metrics_port}
    if not cfg.auth.enabled:  # a daemon that trusts every caller is published on loopback only
        assert all(host == "127.0.0.1" for host in ports.values()), ports
    # Redis: a password the daemon uses, never published; the cluster secret from the environment.
    redis_cmd = [substitute(str(a), secrets) for a in services["redis"]["command"]]
    assert "ports" not in services["redis"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1] == cfg.cluster.redis_password
    assert {"REDIS_PASSWORD", "ENGRAM_CLUSTER_SECRET"} <= secrets and cfg.cluster.secret.startswith("stand-in-")
    assert all(host == "127.0.0.1" for host in published(services["prometheus"]["ports"]).values())
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


def test_makefile_installs_the_cpu_build_of_torch() -> None:
    """PyPI's torch==2.13.0 is the multi-GB CUDA build; `make demo` / `make test` promise the CPU one."""
    text = (REPO / "Makefile").read_text()
    index = re.search(r"^TORCH_INDEX \?= (\S+)$", text, re.M)
    assert index is not None and index.group(1) == "https://download.pytorch.org/whl/cpu"
    installs = [line for line in text.splitlines() if "pip install" in line and "torch" in line]
    assert installs and all("torch==2.13.0" in line and "--index-url $(TORCH_INDEX)" in line for line in installs)
