"""The model-owned adapter generation on CUDA (tests/engine/fastpath/test_adapter_generation.py's
checks with the Triton kernels and the CUDA fused AdamW, the engine's optimizer there): two models
in one process keep their own cached adapter weights; a rollback and a resume are seen by the
fused LoRA path."""

import pytest
import torch

from tests.engine.fastpath.test_adapter_generation import check_rollback_and_resume, check_two_models

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")


def test_two_models_keep_their_caches_on_cuda():
    check_two_models(CUDA)


def test_a_rollback_and_a_resume_are_seen_on_cuda(tmp_path):
    check_rollback_and_resume(CUDA, tmp_path)
