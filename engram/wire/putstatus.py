"""A gRPC Put's status as the daemon sent it, where grpc.aio puts its own INTERNAL in its place.

Why: a Put's requests are sent by gRPC's own task, from a request iterator. When the daemon ends the call early
(a refusal: a wrong dtype, a quota, a model it does not know after a restart), the send then in flight fails and
grpc.aio (1.85, aio/_call.py `_write`) sets the call's status to INTERNAL "Internal error from Core", over the
daemon's when that had come first. Callers got DaemonError INTERNAL for a wrong dtype (14 puts of 4,000 tokens
in 15) or a quota refusal; after a restart, put() and put_blocks() saw no UnknownModel and did not register the
model again, and put()'s retry after its skipped prefix was evicted (FailedPrecondition) did not happen (an
audit, session 48). A call's done callbacks run once, at its first status: that one is kept, and when the call
fails with grpc's own INTERNAL, the daemon's is what it failed with.
"""

from __future__ import annotations

from typing import Any

import grpc

SEND_FAILED = "Internal error from Core"  # grpc.aio's details for the INTERNAL it sets when a send fails
_CODE_OF = {code.value[0]: code for code in grpc.StatusCode}


class DaemonStatus:
    """Watches one stream-unary call from its start (before it can end)."""

    def __init__(self, call: Any) -> None:
        self._first: Any = None
        call.add_done_callback(self._ended)

    def _ended(self, call: Any) -> None:
        # grpc.aio keeps the status on its cython call; a gRPC without it leaves the error as it is raised
        self._first = getattr(getattr(call, "_cython_call", None), "_status", None)

    def error(self, exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """The call's failure as the daemon sent it: `exc`, unless that is grpc's own INTERNAL for a failed send
        and the call's first status was another."""
        first = self._first
        if exc.code() != grpc.StatusCode.INTERNAL or exc.details() != SEND_FAILED or first is None:
            return exc
        code = _CODE_OF.get(first.code())
        if code is None or code == grpc.StatusCode.OK or first.details() == SEND_FAILED:
            return exc
        return grpc.aio.AioRpcError(code, exc.initial_metadata(), grpc.aio.Metadata(*(first.trailing_metadata() or ())),
                                    first.details(), first.debug_error_string())
