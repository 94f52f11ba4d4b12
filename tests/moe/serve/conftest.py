"""Fixtures of the serving tests (tests/moe/serve/serving_util.py builds what they hand out)."""

import pytest

from moe.testing.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Directory of a tiny random Qwen2-MoE checkpoint with its tokenizer and chat template."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-moe"))
