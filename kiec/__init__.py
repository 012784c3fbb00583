"""kiec: compiles a decoder-only LLM into one persistent GPU kernel for batch-1 decode."""
__version__ = "0.1.0"
