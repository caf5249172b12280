"""The `engram` command's entry point (the console script and `python -m engram`). Loading the CLI imports grpc
and typer (0.3 s here, more on a loaded host): a Ctrl-C meanwhile ends quietly with 130, as a shell's interrupted command
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
