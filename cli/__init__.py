"""The `engram` command line (Typer + Rich); installed as engram.cli."""

import os

# gRPC's core writes a failed TLS handshake to stderr itself (an INFO line of ssl_transport_security.cc, in no
# format of the CLI's or the daemon's logs) before the command says what failed. It reads GRPC_VERBOSITY once,
# when grpc is imported: set here, before any command imports it; a value of the user's own is kept.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
