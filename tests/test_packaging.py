"""The distribution ships every package of the source tree, and the public surface is pinned."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, rel in dirs.items():
        root = REPO / rel
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if any(p.startswith((".", "_")) or p == "__pycache__" for p in parts):
                continue
            sub = ".".join((name, *parts))
            # a sub-directory mapped elsewhere by package-dir belongs to that mapping
            if sub == name or sub not in dirs:
                found.add(sub)
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_console_script_points_at_the_cli() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"engram": "engram.command:main"}
