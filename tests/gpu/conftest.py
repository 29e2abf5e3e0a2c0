"""Set-up shared by the GPU tests: fp32 comparisons mean fp32 matmuls (no TF32), and no test
leaves CUDA's sync debug mode on for the next."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
