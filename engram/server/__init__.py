"""The gRPC edge of the daemon: service, error mapping, and the server factory."""

from engram.server.app import RunningServer, build_store, serve, start_server

__all__ = ["RunningServer", "build_store", "serve", "start_server"]
