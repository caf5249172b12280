"""Engram inside serving stacks: Hugging Face transformers (transformers.py) and a vLLM KV connector (vllm)."""
