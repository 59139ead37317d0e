"""Diagnostics: timers and profilers of the library's internals (their names change with the code)."""
