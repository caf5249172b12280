"""docs/CONFIG.md and engram.example.toml are generated from engram/config.py (scripts/gen_config_docs.py):
they must be what the code generates now, document every key, and the example must load back to the defaults."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from engram.config import EngramConfig, config_keys, load_config

REPO = Path(__file__).resolve().parent.parent


def generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclass looks its module up there
    spec.loader.exec_module(gen)
    return gen


def test_generated_files_are_fresh() -> None:
    for rel, text in generator().generate().items():
        assert (REPO / rel).read_text() == text, f"{rel} is stale: run `python scripts/gen_config_docs.py`"


def test_every_key_is_documented() -> None:
    gen = generator()
    documented = {k.dotted: k for k in gen.all_keys()}
    plain = {k for k in documented if ".NAME." not in k}
    assert plain == set(config_keys()) - {"auth.tenants"}
    assert {k.split(".NAME.")[1] for k in documented if ".NAME." in k} == {"token", "namespaces", "quota",
                                                                            "max_sessions"}
    assert [k for k, v in documented.items() if not v.meaning] == [], "give these keys a comment in engram/config.py"
    reference = (REPO / "docs" / "CONFIG.md").read_text()
    for key in documented.values():
        assert f"`{gen.env_name(key.dotted)}`" in reference


def test_example_has_every_key_and_loads_to_the_defaults(tmp_path: Path) -> None:
    example = REPO / "engram.example.toml"
    assert load_config(example, env={}) == EngramConfig().validate()
    text = example.read_text()
    for key in config_keys():
        if key == "auth.tenants":
            continue
        section, name = key.rsplit(".", 1)
        body = text.split(f"\n[{section}]\n", 1)[1].split("\n[", 1)[0]
        assert re.search(rf"^{name} = ", body, re.M), f"{key} is missing from engram.example.toml"
    # The commented tenant table, uncommented, is a valid tenant.
    tenant = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# ") and "=" in line
                       and text.index("# [auth.tenants.") < text.index(line) < text.index("\n[cluster]"))
    config = tmp_path / "tenant.toml"
    config.write_text('[auth]\nsalt_secret = "s"\n[auth.tenants.team-a]\n' + tenant.replace('token = ""', 'token = "t"'))
    assert load_config(config, env={}).auth.tenants["team-a"].token == "t"
