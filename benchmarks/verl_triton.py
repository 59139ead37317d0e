"""verl's fused heads as baselines: verl 0.9.1's Triton `linear_cross_entropy` and its torch backend
(`FusedLinearForPPO`), from the installed verl or else from a verl wheel.

Importing the `verl` package pulls Ray and its whole runtime, so without an installed verl the three files that
hold the kernels are loaded from the wheel (default `.whl/verl-0.9.1-py3-none-any.whl`) under empty stand-ins for
their packages and a small stand-in for `verl.utils.device` (the CUDA device queries they make).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = Path(".whl/verl-0.9.1-py3-none-any.whl")
KERNEL_FILES = ("verl/utils/kernel/kernels.py", "verl/utils/kernel/linear_cross_entropy.py",
                "verl/utils/experimental/torch_functional.py")  # fmt: skip
PACKAGES = ("verl", "verl/utils", "verl/utils/kernel", "verl/utils/experimental")
DEVICE_STUB = """import torch
is_cuda_available = torch.cuda.is_available()
def get_device_name(): return "cuda"
def get_torch_device(): return torch.cuda
def get_device_capability(): return torch.cuda.get_device_capability()
"""


def _import_heads():
    lce = importlib.import_module("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    return lce, importlib.import_module("verl.utils.experimental.torch_functional").FusedLinearForPPO


@functools.cache
def load(wheel: Path = WHEEL):
    """(verl's linear_cross_entropy, verl's FusedLinearForPPO), or a string saying why they cannot be loaded."""
    try:
        return _import_heads()
    except ImportError:
        pass
    if not wheel.exists():
        return f"skipped: verl is not installed and there is no verl wheel at {wheel}"
    root = Path(tempfile.mkdtemp(prefix="verl-kernels-"))
    with zipfile.ZipFile(wheel) as z:
        for name in KERNEL_FILES:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(z.read(name))
    for package in PACKAGES:
        (root / package / "__init__.py").touch()
    (root / "verl/utils/device.py").write_text(DEVICE_STUB)
    sys.path.insert(0, str(root))
    try:
        return _import_heads()
    except Exception as e:  # noqa: BLE001 - report, never drop silently
        return f"skipped: verl's kernel files did not load ({type(e).__name__}: {str(e)[:100]})"


def version(wheel: Path = WHEEL) -> str:
    """The verl the heads come from: the installed one, else the wheel's file name."""
    try:
        return md.version("verl")
    except md.PackageNotFoundError:  # not installed: the wheel, if any
        return f"{wheel.name} (kernel files)" if wheel.exists() else "not installed"
