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
