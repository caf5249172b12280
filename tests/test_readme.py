"""README.md's code blocks, run: a README line that stops being true fails here.

- Every TOML block loads with the config loader (the files it names exist as stand-ins, the env:VAR secrets
  are resolved only when a daemon starts).
- Every `engram` command of the bash blocks exists with the flags it uses; every `--set` names a config key.
- The inspection commands ("Inspecting a running daemon") run against a real daemon holding a session in
  team-a and blocks in team-b, with SESSION and the key prefix 3ae67ee3 replaced by real ones, and exit 0.
- The client library's and the transformers Python blocks run as scripts against a real daemon (their free
  names filled in: tokens and KV of the shapes the comments give, a tiny random Llama for `model`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from engram.cli.main import app
from engram.client import SyncEngramClient
from engram.config import config_keys, load_config

from helpers import NEUTRAL_CWD, engram_daemon, missing, random_kv, tiny_model, tokens

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands() -> list[list[str]]:
    """Every `engram ...` command line of the bash blocks, as argv (comments dropped, `a ; b` split)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            for part in line.split(" ; "):
                argv = shlex.split(part, comments=True)
                if argv and argv[0] in ("engram", ".venv/bin/engram"):
                    out.append(["engram", *argv[1:]])
    return out


def test_toml_blocks_load(tmp_path: Path) -> None:
    tomls = blocks("toml")
    assert len(tomls) >= 2  # tenants, cluster
    for n, text in enumerate(tomls):
        for path in sorted(set(re.findall(r'"(/etc/engram/[^"]+)"', text))):
            stand_in = tmp_path / Path(path).name
            stand_in.write_text("stand-in")
            text = text.replace(path, str(stand_in))
        config = tmp_path / f"block{n}.toml"
        config.write_text(text)
        cfg = load_config(config, env={})
        assert cfg.auth.enabled or cfg.cluster.redis_url


def test_every_command_and_flag_exists() -> None:
    root = typer.main.get_command(app)
    found = commands()
    assert len(found) >= 15
    keys = set(config_keys())
    for argv in found:
        command = root.commands.get(argv[1])  # type: ignore[attr-defined]
        assert command is not None, f"README: engram has no command {argv[1]!r}"
        flags = {opt for p in command.params for opt in p.opts}
        for i, arg in enumerate(argv[2:], start=2):
            if arg.startswith("-"):
                assert arg.split("=")[0] in flags, f"README: engram {argv[1]} has no option {arg}"
            if argv[i - 1] == "--set":
                assert arg.split("=")[0] in keys, f"README: --set {arg} names no config key"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(address, a session id in team-a, the key of a team-a block no session uses)."""
    with engram_daemon(tmp_path) as (address, _):
        spec = tiny_model()
        with SyncEngramClient(address, namespace="team-a") as c:
            fp = c.register_model(spec)
            toks = tokens(48)
            c.put(fp, toks, random_kv(spec, 48))
            c.open_session(fp, mode="persist", session_id="chat-42", tokens=toks)
            loose = c.put(fp, tokens(32, seed=3), random_kv(spec, 32, seed=3)).keys[0]
            c.put(fp, tokens(40, seed=9), random_kv(spec, 40, seed=2), namespace="team-b")
        yield address, "chat-42", loose.hex()


def test_inspection_commands_run_against_a_daemon(daemon: tuple[str, str, str]) -> None:
    address, session, key = daemon
    section = README.split("Inspecting a running daemon", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    ran = 0
    for argv in (a for a in commands() if " ".join(a) in section.replace(".venv/bin/", "")):
        if argv[1] == "serve":
            continue  # its flags are checked above; the daemon here is the fixture's
        argv = [{"SESSION": session, "3ae67ee3": key[:8]}.get(a, a) for a in argv[1:]]
        if argv[0] == "top":
            argv += ["--once", "--interval", "0.05"]  # the README's top runs until Ctrl-C
        result = CliRunner().invoke(app, [*argv, "--address", address])
        assert result.exit_code == 0, f"README: engram {' '.join(argv)} -> {result.exit_code}: {result.output}"
        ran += 1
    assert ran >= 9


def test_client_library_snippet_runs(tmp_path: Path) -> None:
    """The "client library underneath" block, as a script: its free names (tokens, kv, full_kv) filled in with
    the shapes its comments give, device cuda -> cpu (no GPU here), the body inside an async main."""
    block = next(b for b in blocks("python") if "EngramClient(" in b and "load_prefix_into" in b)
    imports = [line for line in block.splitlines() if line.startswith(("from ", "import "))]
    body = [line for line in block.splitlines() if line and not line.startswith(("from ", "import "))]
    with engram_daemon(tmp_path) as (address, _):
        script = "\n".join([
            "import asyncio", "import torch", *imports, "",
            "async def main() -> None:",
            "    tokens = list(range(512))                                  # two blocks of 256",
            "    full_kv = torch.randn(12, 2, 512, 8, 64).bfloat16()",
            "    kv = torch.zeros(12, 2, 512, 8, 64, dtype=torch.bfloat16)",
            *("    " + line for line in body),
            "    assert res.loaded_tokens == 0 and matched == 512 and kv.shape == (12, 2, 512, 8, 64)",
            "    print('ok', (kv.float() - full_kv.float()).norm().item() / full_kv.float().norm().item())",
            "", "asyncio.run(main())", ""]).replace("unix:/run/engram.sock", address).replace('"cuda"', '"cpu"')
        (tmp_path / "snippet.py").write_text(script)
        out = subprocess.run([sys.executable, str(tmp_path / "snippet.py")], capture_output=True, text=True,
                             timeout=300, cwd=NEUTRAL_CWD)
        default = asyncio.run(_default_codec(address))
    assert out.returncode == 0, out.stderr + script
    word, error = out.stdout.split()
    assert word == "ok"
    if default == "nvfp4":  # close, not equal (README says so)
        assert 0 < float(error) < 0.2
    else:  # auto found no fast encoder here: raw, exact
        assert default == "raw" and float(error) == 0


async def _default_codec(address: str) -> str:
    from engram.control import ControlClient

    async with ControlClient(address) as c:
        return (await c.stats()).default_codec


def test_transformers_snippet_runs(tmp_path: Path) -> None:
    """README's two-line transformers change, as a script, with a tiny random Llama for `model`."""
    if importlib.util.find_spec("transformers") is None:  # a declared test dependency (ENGRAM_TESTS_WITHOUT)
        missing("transformers", "the transformers integration needs it (pip install -e '.[dev]')")
    block = next(b for b in blocks("python") if "EngramPrefixCache(" in b)
    with engram_daemon(tmp_path) as (address, _):
        script = "\n".join([
            "import torch", "import transformers as tf", block.replace("unix:/run/engram.sock", address),
            "print(out.shape[1], cache.client.stats().tier('dram').blocks > 0)",
        ]).replace("cache = EngramPrefixCache", "\n".join([
            "torch.manual_seed(0)",
            "model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, vocab_size=256, hidden_size=64, "
            "intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)).eval()",
            "input_ids = torch.randint(0, 256, (1, 40))",
            "cache = EngramPrefixCache"]))
        (tmp_path / "snippet.py").write_text(script)
        out = subprocess.run([sys.executable, str(tmp_path / "snippet.py")], capture_output=True, text=True,
                             timeout=300, cwd=NEUTRAL_CWD)
    assert out.returncode == 0, out.stderr[-3000:] + script
    assert out.stdout.split() == ["296", "True"]  # 40 prompt tokens + max_new_tokens=256; its KV stored
