"""The gRPC edge of the daemon: the service and its handlers, the error mapping, peers, and the server
factory (app.py). Names are loaded on first use, so importing one module of the package (say, the error
wrappers) does not build the whole daemon."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RunningServer", "build_store", "serve", "start_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("engram.server.app"), name)
    raise AttributeError(f"module 'engram.server' has no attribute {name!r}")
