"""Fixtures shared by the bench's CPU tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    # The tiny models gain nothing from threads; on a 2-core machine running tests they only wait.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
