"""When a client may still make calls: until close(), which ends the calls then in flight too.

Why: `SyncEngramClient.close()` stopped the client's event loop and left the calls other threads had in flight on
it unresolved: those threads blocked forever on a data-channel or in-place put, and a gRPC call got a bare
CancelledError (an audit, session 48), though every call of the client is bounded by timeout_s. A call after
close failed RuntimeError "Event loop is closed" (and Python warned of a coroutine never awaited), or on the
async client grpc's UsageError "Channel is closed". Each now raises ClientClosed, saying which it was.
"""

from __future__ import annotations

from engram import errors

AFTER_CLOSE = "the client is closed (close() was called): make a new client to go on"
WHILE_RUNNING = ("the client was closed (close(), from another thread or task) while this call ran: the call was "
                 "given up, and what it did at the daemon before is not known (a put may be stored in part; put "
                 "again on a new client)")


def closed() -> errors.ClientClosed:
    return errors.ClientClosed(AFTER_CLOSE)


def closed_while_running() -> errors.ClientClosed:
    return errors.ClientClosed(WHILE_RUNNING)
