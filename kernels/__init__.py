"""Triton kernels, installed as engram.kernels.

Importing this package never imports Triton, so the daemon runs where Triton is missing; import the kernel
modules (engram.kernels.fp4) only where `triton_available()` is true.
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
