"""docs/api.md keeps step with the code: every setting, constructor option, call input and output field has a
row (a new one without a row fails here), and no row names something that does not exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from compiled_grpo import GRPOLossOutput
from compiled_grpo.config import SETTING_NAMES
from compiled_grpo.loss import CONSTRUCTOR_OPTIONS

DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
POSITIONAL = ("hidden", "weight", "completion_ids", "completion_mask", "advantages")


def rows_of(section: str) -> list[str]:
    """The names in the first column of a section's table."""
    body = DOC.split(f"## {section}\n")[1].split("\n## ")[0]
    return re.findall(r"^\| `([a-z_]+)` \|", body, flags=re.MULTILINE)


def primitive_options() -> tuple[str, ...]:
    import inspect

    from compiled_grpo.logprobs import TILE_OPTIONS, fused_linear_logprobs

    keyword = inspect.Parameter.KEYWORD_ONLY
    names = [p.name for p in inspect.signature(fused_linear_logprobs).parameters.values() if p.kind == keyword]
    return (*names, *TILE_OPTIONS)


def call_inputs() -> tuple[str, ...]:
    from compiled_grpo.loss import CALL_INPUTS

    return POSITIONAL + CALL_INPUTS


@pytest.mark.parametrize(
    "section, names",
    [
        ("Settings", SETTING_NAMES),
        ("Constructor options", CONSTRUCTOR_OPTIONS),
        ("Call inputs", call_inputs()),
        ("Output", tuple(f.name for f in dataclasses.fields(GRPOLossOutput))),
        ("Primitive", primitive_options()),
    ],
)
def test_every_name_has_a_row_and_every_row_a_name(section, names):
    rows = rows_of(section)
    assert sorted(set(names) - set(rows)) == [], f"missing from docs/api.md, {section}"
    assert sorted(set(rows) - set(names)) == [], f"in docs/api.md, {section}, but not in the code"
