"""Every python block of README.md and docs/*.md parses, and the TRL ones run as written on a tiny model."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(python_blocks(page))]


@pytest.mark.parametrize("page, i, code", BLOCKS, ids=[f"{p.relative_to(ROOT)}#{i}" for p, i, _ in BLOCKS])
def test_python_block_parses(page, i, code):
    ast.parse(code, filename=f"{page.name} block {i}")


TRL_BLOCKS = [(page, i, code) for page, i, code in BLOCKS if "CompiledGRPOTrainer(" in code]


def test_the_trl_blocks_are_found():
    assert {page.name for page, _, _ in TRL_BLOCKS} >= {"README.md", "usage.md"}


@pytest.mark.parametrize("page, i, code", TRL_BLOCKS, ids=[f"{p.relative_to(ROOT)}#{i}" for p, i, _ in TRL_BLOCKS])
def test_trl_block_trains_a_tiny_model(page, i, code, tmp_path, monkeypatch):
    """The block as written, with the user's objects (model, tokenizer, reward, prompts) made tiny here and the run
    cut to one optimizer step (GRPOConfig's size arguments overridden; the block's own settings, its device and
    precision among them, kept: on this CPU-only machine the block must pick them itself)."""
    pytest.importorskip("trl")
    import trl

    from compiled_grpo.integrations import trl as integration

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import train_trl_grpo as example
    from datasets import Dataset

    real = trl.GRPOConfig

    def tiny_run(**kwargs):  # the run's size only: the device and precision are the block's own
        kwargs.update(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to=[], save_strategy="no")  # fmt: skip
        return real(**kwargs)

    monkeypatch.setattr(trl, "GRPOConfig", tiny_run)
    # the tiles eagerly: compiling them is what the compiled tests check, and would take most of this test's time
    monkeypatch.setitem(integration.CompiledGRPOTrainer.__init__.__kwdefaults__, "compiled", False)
    tokenizer = example.local_tokenizer()
    prompts = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i"]})
    scope = {"model": example.tiny_llama(len(tokenizer)), "tokenizer": tokenizer, "reward": example.digit_reward,
             "ascending_digits": example.ascending_digits, "dataset": prompts, "prompts": prompts}  # fmt: skip
    exec(compile(code, f"{page.name} block {i}", "exec"), scope)  # noqa: S102 - the documentation's own code
    assert scope["trainer"].state.global_step == 1
