"""The `engram` command's entry point (the console script and `python -m engram`). Loading the CLI imports torch
and grpc, seconds on a small host: a Ctrl-C meanwhile now ends quietly with 130, as a shell's interrupted command
does, where Python printed the traceback of whichever import it stopped."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT


def main() -> None:
    try:
        from engram.cli.main import app
    except KeyboardInterrupt:
        sys.stderr.write("\n")  # after the terminal's ^C
        raise SystemExit(EXIT_INTERRUPTED) from None
    app()
