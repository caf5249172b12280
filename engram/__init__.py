"""Engram: a tiered KV-cache daemon for LLM inference."""

__version__ = "0.1.0"
