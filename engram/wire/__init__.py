"""The gRPC wire, shared by the client library and the daemon: protobuf <-> domain conversion (convert),
status codes <-> domain errors (status), chunking and stream reassembly (stream), and channels (channel).

Protobuf messages are built and read only here, in engram/server/ and in engram/client.py; everything else
speaks engram.api's dataclasses. Nothing in this package imports the daemon.
"""
