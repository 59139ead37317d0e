"""Unsloth's GRPO head as a baseline: `fused_linear_logprobs` of unsloth_zoo, the op Unsloth's GRPO trainer calls
for the policy's per-token log-probs. By default (on a GPU whose GEMMs have a float32 output) it keeps the product
in float32 in the forward and in its recomputing backward, as this library's default does (TRL's head rounds it
to bf16); it computes the entropy only when asked (`return_entropy`), has no top_entropy_quantile and no loss of
its own (the benchmark puts the same loss on top), and skips no rows by their upstream gradient.

The `unsloth_zoo` package refuses to import without `unsloth` (and `unsloth` patches transformers on import), so
the one file that holds the op, `unsloth_zoo/fused_losses/fused_linear.py`, is loaded from the wheel
(`--unsloth-wheel`, default `.whl/unsloth_zoo-2026.10.9-py3-none-any.whl`) under empty stand-ins for its two
packages; its only other import from the package (a free-memory probe for its chunk budget) falls back to its
own default when absent, as the file itself provides.
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = Path(".whl/unsloth_zoo-2026.10.9-py3-none-any.whl")
OP_FILE = "unsloth_zoo/fused_losses/fused_linear.py"


@functools.cache
def load(wheel: Path = WHEEL):
    """unsloth_zoo's `fused_linear_logprobs`, or a string saying why it cannot be loaded here."""
    if not wheel.exists():
        return f"skipped: no unsloth_zoo wheel at {wheel}"
    root = Path(tempfile.mkdtemp(prefix="unsloth-head-"))
    with zipfile.ZipFile(wheel) as z:
        (root / OP_FILE).parent.mkdir(parents=True)
        (root / OP_FILE).write_bytes(z.read(OP_FILE))
    for package in ("unsloth_zoo", "unsloth_zoo/fused_losses"):
        (root / package / "__init__.py").touch()
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("unsloth_zoo.fused_losses.fused_linear").fused_linear_logprobs
    except Exception as e:  # noqa: BLE001 - report, never drop silently
        return f"skipped: unsloth_zoo's fused_linear.py did not load ({type(e).__name__}: {str(e)[:100]})"
    finally:
        sys.path.remove(str(root))
