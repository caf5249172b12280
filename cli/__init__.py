"""The `engram` command line (Typer + Rich); installed as engram.cli."""
