"""Benchmarks: eager vs compiled, and the lm_head GEMM floor, measured side by side in one process."""
