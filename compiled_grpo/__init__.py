"""compiled-grpo: the GRPO loss family fused with the LM head, compile-first."""

__version__ = "0.1.0"
