"""Fixtures of the model and engine tests: the tiny random checkpoint of every family (tests/moe/families.py)."""

import pytest

from moe.testing.tiny_checkpoint import randomize
from tests.moe.families import COMMON, FAMILIES, family_index


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family name, transformers model in eval mode, saved checkpoint directory)."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    randomize(model, seed=len(request.param) + family_index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, model, path
