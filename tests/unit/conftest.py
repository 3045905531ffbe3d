"""Fixtures for the unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two cores are shared with other work: keep torch to one thread in a module that
    runs models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """The tiny Llama as a GenerationRuntime, loaded once per test module (tests may
    patch it; a module's patches never reach another's)."""
    from serve_app.core.models import LoadOptions, load_runtime

    return load_runtime(LoadOptions(source=str(tiny_llama_dir), task="text-generation"))
