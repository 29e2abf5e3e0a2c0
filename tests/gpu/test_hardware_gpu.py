"""GPU-host checks for engine.hardware.detect(): the real device is classified and measured
(run with `pytest -m gpu tests/gpu/test_hardware_gpu.py`)."""

import pytest
import torch

from engine.config import RunConfig
from engine.hardware.policy import apply_defaults, format_profile
from engine.hardware.profile import GiB, detect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_detect_reads_the_gpu():
    p = detect()
    props = torch.cuda.get_device_properties(0)
    assert p.kind != "cpu", p.kind_reason
    assert p.gpu_name == props.name
    assert p.compute_capability == (props.major, props.minor)
    assert p.total_vram == props.total_memory
    assert 0 < p.free_vram <= p.total_vram
    assert p.gpu_count == torch.cuda.device_count()
    assert p.cuda_version == torch.version.cuda
    cfg = apply_defaults(RunConfig(), p)
    assert cfg.training.device == "cuda"
    print(format_profile(p))


def test_h200_is_datacenter_with_bf16():
    p = detect()
    if "H200" not in (p.gpu_name or ""):
        pytest.skip(f"not an H200 host ({p.gpu_name})")
    assert p.kind == "datacenter", p.kind_reason
    assert p.total_vram > 130 * GiB  # 141 GB card: about 139-144 GiB as reported
    assert p.bf16_supported and p.compute_capability == (9, 0)
    assert not p.integrated_memory and p.arch in ("x86_64", "aarch64")
    cfg = apply_defaults(RunConfig(), p)
    assert cfg.model.dtype == "bfloat16" and cfg.model.load_in_4bit is False
    assert cfg.training.rows_per_micro_batch * cfg.data.max_seq_len >= 8192
