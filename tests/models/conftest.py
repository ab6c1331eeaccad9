"""The shared parametrisation of the model-level tests: one tiny model per architecture."""

import pytest
from tiny_models import ARCHS, build_tiny


@pytest.fixture(params=list(ARCHS))
def arch(request):
    """Each architecture of ``tiny_models.ARCHS`` (Llama ... Gemma3)."""
    return request.param


@pytest.fixture
def tiny():
    """The factory: ``tiny(arch, **config_overrides)`` builds a fresh fp32 eval-mode model."""
    return build_tiny
