"""nightshift: self-hosted batch LLM inference (OpenAI Batch files in, sorted sharded results out)."""

__version__ = "0.1.0"
