"""Trace replay: judge the cache policy on request traces (Mooncake JSONL, or Engram's session format)
against LRU and Belady's offline optimum at the same capacities."""

from engram.trace.formats import Request, block_tokens_of, in_time_order, read_trace, write_trace
from engram.trace.replay import POLICIES, PolicyResult, TierResult, TierSpec, replay_all
from engram.trace.synth import agent_trace

__all__ = [
           "POLICIES",
           "PolicyResult",
           "Request",
           "TierResult",
           "TierSpec",
           "agent_trace",
           "block_tokens_of",
           "in_time_order",
           "read_trace",
           "replay_all",
           "write_trace",
]
