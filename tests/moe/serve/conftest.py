"""Fixtures of the serving tests (tests/moe/serve/serving_util.py builds what they hand out)."""

import pytest

from moe.testing.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Directory of a tiny random Qwen2-MoE checkpoint with its tokenizer and chat template."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-moe"))


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, tiny_dir):
    """family (a FAMILY_CONFIGS key) -> the directory of its tiny checkpoint, written once a session
    (qwen2_moe's is tiny_dir)."""
    made = {"qwen2_moe": tiny_dir}

    def get(family: str):
        if family not in made:
            made[family] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return made[family]

    return get
