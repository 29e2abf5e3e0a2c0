"""Tests for engine.hardware: classification and defaults from injected device properties
(an RTX 4060 Laptop, an RTX 4090, an H200, a GB10, no GPU), and detect() on this machine."""

import json
import subprocess
import sys

import pytest
from transformers import Qwen3Config

from engine.config import AUTO, RunConfig
from engine.hardware import policy
from engine.hardware.policy import apply_defaults, explain_defaults, format_profile, resolve_defaults
from engine.hardware.profile import (
    KINDS,
    GiB,
    GpuProperties,
    HardwareProfile,
    MiB,
    classify,
    detect,
    profile_from_properties,
)
from engine.models.estimate import model_info

HARDWARE_FIELDS = [
    "training.device",
    "model.dtype",
    "model.load_in_4bit",
    "training.rows_per_micro_batch",
    "training.gradient_checkpointing",
    "training.offload",
    "fast_paths.kernels",
    "fast_paths.lora_autograd",
    "fast_paths.fused_ce",
    "fast_paths.packed_attention",
    "fast_paths.moe_grouping",
    "fast_paths.ce_chunk_tokens",
]
FAST = ["kernels", "lora_autograd", "fused_ce", "packed_attention"]
KERNEL_PATHS = ["kernels", "lora_autograd", "fused_ce"]  # packed attention is on everywhere


def laptop_4060():
    return profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4060 Laptop GPU", 8188 * MiB, (8, 9), free_memory=7400 * MiB),
        os_name="Windows",
        arch="AMD64",
        cpu_count=16,
        ram_total=32 * GiB,
        ram_available=20 * GiB,
    )


def desktop_4090():
    return profile_from_properties(GpuProperties("NVIDIA GeForce RTX 4090", 24564 * MiB, (8, 9)), cpu_count=16)


def h200():
    return profile_from_properties(
        GpuProperties("NVIDIA H200", 143771 * MiB, (9, 0), free_memory=143000 * MiB), cpu_count=16, ram_total=128 * GiB
    )


def gb10():
    # cudaMemGetInfo under-reports on unified memory; the OS's available figure is larger.
    return profile_from_properties(
        GpuProperties("NVIDIA GB10", int(119.7 * GiB), (12, 1), integrated=True, free_memory=60 * GiB),
        arch="aarch64",
        cpu_count=20,
        ram_total=int(119.7 * GiB),
        ram_available=110 * GiB,
    )


def no_gpu():
    return profile_from_properties(None, cpu_count=8, ram_total=32 * GiB, ram_available=24 * GiB)


def qwen3_8b():
    return model_info(
        Qwen3Config(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
        )
    )


def qwen3_06b():
    return model_info(
        Qwen3Config(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        )
    )


def config_for(name="example/not-cached-model", **training):
    # A Hub id that is not in the local cache: the model size is unknown unless passed in.
    cfg = RunConfig()
    cfg.model.name_or_path = name
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return cfg


# -- classification ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cap, kind",
    [
        ("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9), "rtx_laptop"),
        ("NVIDIA GeForce RTX 3080 Ti Laptop GPU", (8, 6), "rtx_laptop"),
        ("NVIDIA RTX A2000 Laptop GPU", (8, 6), "rtx_laptop"),
        ("NVIDIA RTX 2000 Ada Generation Laptop GPU", (8, 9), "rtx_laptop"),
        ("Quadro RTX 5000 with Max-Q Design", (7, 5), "rtx_laptop"),
        ("NVIDIA GeForce MX450", (7, 5), "rtx_laptop"),
        ("NVIDIA GeForce RTX 4090", (8, 9), "rtx_desktop"),
        ("NVIDIA GeForce RTX 5090", (12, 0), "rtx_desktop"),
        ("NVIDIA RTX A6000", (8, 6), "rtx_desktop"),
        ("NVIDIA RTX 6000 Ada Generation", (8, 9), "rtx_desktop"),
        ("NVIDIA RTX A2000", (8, 6), "rtx_desktop"),
        ("Quadro RTX 8000", (7, 5), "rtx_desktop"),
        ("NVIDIA TITAN RTX", (7, 5), "rtx_desktop"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "datacenter"),
        ("NVIDIA H100 80GB HBM3", (9, 0), "datacenter"),
        ("NVIDIA H200", (9, 0), "datacenter"),
        ("NVIDIA GH200 480GB", (9, 0), "datacenter"),
        ("NVIDIA B200", (10, 0), "datacenter"),
        ("NVIDIA L40S", (8, 9), "datacenter"),
        ("NVIDIA L4", (8, 9), "datacenter"),
        ("NVIDIA A10G", (8, 6), "datacenter"),
        ("Tesla T4", (7, 5), "datacenter"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), "datacenter"),
        ("NVIDIA Hopper Engineering Sample", (9, 0), "datacenter"),  # by capability
        ("Some Future GPU", (8, 6), "rtx_desktop"),  # unknown consumer capability
    ],
)
def test_classify_by_name_and_capability(name, cap, kind):
    got, reason = classify(GpuProperties(name, 16 * GiB, cap))
    assert got == kind, reason
    assert reason


def test_classify_spark_and_unusable_accelerators():
    spark = GpuProperties("NVIDIA GB10", 120 * GiB, (12, 1), integrated=True)
    assert classify(spark, arch="aarch64")[0] == "dgx_spark"
    jetson = GpuProperties("Orin", 32 * GiB, (8, 7), integrated=True)
    assert classify(jetson, arch="aarch64")[0] == "dgx_spark"
    assert classify(None) == ("cpu", "no GPU found by torch")
    kind, reason = classify(None, backend="mps")
    assert kind == "cpu" and "MPS" in reason
    kind, reason = classify(GpuProperties("AMD Instinct MI300X", 192 * GiB, (9, 4)), backend="rocm")
    assert kind == "cpu" and "ROCm" in reason


def test_profile_facts_and_to_dict():
    p = h200()
    assert p.kind == "datacenter" and p.gpu_count == 1 and p.bf16_supported and not p.integrated_memory
    assert p.total_vram == 143771 * MiB and p.free_vram == 143000 * MiB
    d = p.to_dict()
    assert d["compute_capability"] == [9, 0] and d["kind"] == "datacenter"
    json.dumps(d)  # plain data, for the hardware panel and bench records
    assert set(KINDS) >= {laptop_4060().kind, desktop_4090().kind, gb10().kind, no_gpu().kind}


def test_turing_has_no_bf16():
    t4 = profile_from_properties(GpuProperties("Tesla T4", 15 * GiB, (7, 5)))
    assert not t4.bf16_supported
    cfg = apply_defaults(config_for(), t4)
    assert cfg.model.dtype == "float16"
    assert cfg.fast_paths.kernels is True  # Turing runs the Triton kernels


def test_old_gpu_uses_reference_paths():
    pascal = profile_from_properties(GpuProperties("NVIDIA GeForce GTX 1080", 8 * GiB, (6, 1)))
    cfg = apply_defaults(config_for(), pascal)
    assert cfg.training.device == "cuda" and cfg.model.dtype == "float16"
    assert all(getattr(cfg.fast_paths, f) is False for f in KERNEL_PATHS)
    assert cfg.fast_paths.packed_attention is True  # the reference keeps documents apart


# -- defaults per class ------------------------------------------------------------------------


def assert_all_filled(original: RunConfig, cfg: RunConfig):
    for path in HARDWARE_FIELDS:
        section, name = path.split(".")
        assert getattr(getattr(cfg, section), name) != AUTO, path
        assert path in cfg.auto_fields
    cfg.validate()
    # The input is not modified.
    assert original.training.device == AUTO and original.auto_fields == []


def test_laptop_4060_with_8b_model_loads_in_4bit():
    original = config_for("Qwen/Qwen3-8B")
    d = resolve_defaults(original, laptop_4060(), qwen3_8b())
    cfg = d.config
    assert_all_filled(original, cfg)
    assert laptop_4060().kind == "rtx_laptop"
    assert cfg.training.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.model.load_in_4bit is True
    assert cfg.training.gradient_checkpointing is True
    assert cfg.training.rows_per_micro_batch == 1
    # The 4-bit run's estimate takes all of the 7.2 GiB free: no room for a second buffer.
    assert cfg.training.offload == "single"
    assert "no room for the second" in d.choices["training.offload"][1]
    assert all(getattr(cfg.fast_paths, f) is True for f in FAST)
    # The chunk of fp32 logits stays inside the budget for an 8 GB card.
    assert cfg.fast_paths.ce_chunk_tokens * 151936 * 4 <= 0.04 * 7400 * MiB
    # No data-loader note: packing runs on the training thread, there is no worker to size.
    assert "data.num_workers" not in d.notes
    assert "desktop and browser" in d.notes["memory.budget"][1]
    assert "16-bit LoRA needs" in d.choices["model.load_in_4bit"][1]
    # Even in 4 bits an 8B model fills an 8 GB card: over 85% of it, under all of it.
    assert 0.85 * 8188 * MiB < d.estimate <= 8188 * MiB
    assert d.verdict == "tight"
    assert any("tight" in w for w in d.warnings), d.warnings


def test_laptop_4060_with_small_model_stays_16bit():
    d = resolve_defaults(config_for("Qwen/Qwen3-0.6B"), laptop_4060(), qwen3_06b())
    cfg = d.config
    assert cfg.model.load_in_4bit is False
    # The micro-batch grows until the budget is full (issue 15: one 1,024-token row used 15% of
    # a 6 GiB card), within the laptop's ceiling.
    tokens = cfg.training.rows_per_micro_batch * cfg.data.max_seq_len
    assert 4096 < tokens <= policy.KIND_RULES["rtx_laptop"].max_tokens
    budget = policy.budget_for("cuda", laptop_4060())
    assert 0.7 * budget.memory < d.estimate <= budget.memory


def test_desktop_4090_trains_8b_in_16bit():
    cfg = apply_defaults(config_for("Qwen/Qwen3-8B"), desktop_4090(), qwen3_8b())
    assert desktop_4090().kind == "rtx_desktop"
    assert cfg.model.load_in_4bit is False and cfg.model.dtype == "bfloat16"
    assert cfg.training.gradient_checkpointing is True
    assert cfg.training.offload == "double"
    # 16-bit weights take ~15 GiB; the micro-batch gets what is left of the budget, under the ceiling.
    tokens = cfg.training.rows_per_micro_batch * cfg.data.max_seq_len
    assert 4096 <= tokens < policy.KIND_RULES["rtx_desktop"].max_tokens


def test_h200_datacenter_defaults():
    p = h200()
    assert p.kind == "datacenter"
    original = config_for("Qwen/Qwen3-8B")
    d = resolve_defaults(original, p, qwen3_8b())
    cfg = d.config
    assert_all_filled(original, cfg)
    assert cfg.training.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.model.load_in_4bit is False
    assert cfg.training.gradient_checkpointing is True
    # The step fits without offload on a datacenter card: no copies to pay for.
    assert cfg.training.offload == "off"
    assert "fits without offload" in d.choices["training.offload"][1]
    assert cfg.training.rows_per_micro_batch * cfg.data.max_seq_len == policy.KIND_RULES["datacenter"].max_tokens
    assert cfg.fast_paths.ce_chunk_tokens >= 1024
    assert d.verdict == "fits"
    # A bigger card gets a bigger cross-entropy chunk than a laptop.
    laptop = apply_defaults(config_for(), laptop_4060())
    assert cfg.fast_paths.ce_chunk_tokens > laptop.fast_paths.ce_chunk_tokens


def test_h200_without_model_info_is_safe():
    cfg = apply_defaults(config_for(), h200())
    assert cfg.model.load_in_4bit is False
    assert cfg.training.gradient_checkpointing is True
    assert cfg.training.offload == "double"
    assert cfg.training.rows_per_micro_batch * cfg.data.max_seq_len == 16384


def test_h200_small_model_skips_checkpointing():
    cfg = apply_defaults(config_for("Qwen/Qwen3-0.6B"), h200(), qwen3_06b())
    assert cfg.training.gradient_checkpointing is False
    assert cfg.training.offload == "off"  # nothing is checkpointed, so nothing to offload


def test_short_free_vram_falls_back_to_single_buffer():
    busy = profile_from_properties(GpuProperties("NVIDIA GeForce RTX 4090", 24564 * MiB, (8, 9), free_memory=2 * GiB))
    d = resolve_defaults(config_for(), busy)
    assert d.config.training.offload == "single"
    assert "only" in d.choices["training.offload"][1]


def test_gb10_dgx_spark_defaults():
    p = gb10()
    assert p.kind == "dgx_spark" and p.integrated_memory and p.arch == "aarch64"
    assert p.free_vram == 110 * GiB  # the OS's available memory, not cudaMemGetInfo's
    original = config_for("Qwen/Qwen3-8B")
    d = resolve_defaults(original, p, qwen3_8b())
    cfg = d.config
    assert_all_filled(original, cfg)
    assert cfg.training.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.training.offload == "off"  # no double buffering on unified memory
    assert "unified memory" in d.choices["training.offload"][1]
    assert cfg.model.load_in_4bit is False
    assert cfg.training.rows_per_micro_batch * cfg.data.max_seq_len >= 8192


def test_no_gpu_cpu_defaults():
    p = no_gpu()
    assert p.kind == "cpu" and p.total_vram == 0 and not p.bf16_supported
    original = config_for()
    d = resolve_defaults(original, p)
    cfg = d.config
    assert_all_filled(original, cfg)
    assert cfg.training.device == "cpu" and cfg.model.dtype == "float32"
    assert cfg.model.load_in_4bit is False
    assert cfg.training.offload == "off"
    assert cfg.training.rows_per_micro_batch in (1, 2)
    assert all(getattr(cfg.fast_paths, f) is False for f in KERNEL_PATHS)
    assert cfg.fast_paths.packed_attention is True
    assert "per-document" in d.choices["fast_paths.packed_attention"][1]
    assert "reference" in d.choices["fast_paths.kernels"][1]


def test_cpu_tiny_model_skips_checkpointing_big_model_keeps_it():
    demo = apply_defaults(RunConfig(), no_gpu())  # the bundled demo model
    assert demo.training.gradient_checkpointing is False
    big = apply_defaults(config_for("Qwen/Qwen3-8B"), no_gpu(), qwen3_8b())
    assert big.training.gradient_checkpointing is True
    assert big.training.rows_per_micro_batch == 1


def test_user_values_are_kept_and_followed():
    cfg = config_for(device="cpu", rows_per_micro_batch=3, offload="single")
    cfg.model.dtype = "float32"
    out = apply_defaults(cfg, h200())
    assert out.training.device == "cpu" and out.training.rows_per_micro_batch == 3
    assert out.training.offload == "single" and out.model.dtype == "float32"
    for path in ("training.device", "training.rows_per_micro_batch", "training.offload", "model.dtype"):
        assert path not in out.auto_fields
    # The CPU policy follows the explicit device.
    assert out.model.load_in_4bit is False and out.fast_paths.kernels is False


def test_apply_is_idempotent():
    once = apply_defaults(config_for(), h200())
    twice = apply_defaults(once, h200())
    assert twice.to_dict() == once.to_dict()


def test_explain_defaults():
    d = resolve_defaults(config_for("Qwen/Qwen3-8B"), laptop_4060(), qwen3_8b())
    cfg = d.config
    lines = d.explain()
    for path in HARDWARE_FIELDS + ["memory.budget"]:
        assert any(line.startswith(path + " = ") for line in lines), path
    assert any("load_in_4bit = true" in line for line in lines)
    # The reasons are not part of the saved config; a reloaded one still lists its values.
    assert "tunesmith_defaults" not in cfg.to_yaml()
    reloaded = RunConfig.from_dict(cfg.to_dict())
    assert explain_defaults(reloaded)[0].startswith(cfg.auto_fields[0] + " = ")


def test_decisions_are_returned_not_attached():
    # apply_defaults gives back a plain RunConfig (no hidden attribute); explain_defaults reads
    # the choices from the config itself and matches the field lines of Defaults.explain().
    d = resolve_defaults(config_for("Qwen/Qwen3-8B"), laptop_4060(), qwen3_8b())
    cfg = apply_defaults(config_for("Qwen/Qwen3-8B"), laptop_4060(), qwen3_8b())
    assert set(vars(cfg)) == set(vars(RunConfig()))
    assert cfg.to_dict() == d.config.to_dict()
    assert explain_defaults(cfg) == d.explain()[: len(d.choices)]
    assert cfg.auto_reasons == {path: reason for path, (_, reason) in d.choices.items()}


def test_each_decision_returns_its_value_and_reason():
    gpu = policy.budget_for("cuda", h200())
    cpu = policy.budget_for("cpu", h200())  # an explicit CPU run on a GPU machine
    assert gpu.on_gpu and gpu.where == "VRAM" and not cpu.on_gpu and cpu.where == "RAM"
    assert policy.budget_for("cuda", gb10()).where == "unified memory"
    budget, reason = policy.memory_budget("cuda", laptop_4060())
    assert budget.memory < budget.free <= budget.total and "RTX laptop" in reason
    assert policy.device_default(h200()) == ("cuda", "NVIDIA H200 (datacenter)")
    assert policy.device_default(no_gpu())[0] == "cpu"
    assert policy.dtype_default(h200(), gpu)[0] == "bfloat16" and policy.dtype_default(h200(), cpu)[0] == "float32"
    assert policy.kernels_default(h200(), gpu)[0] is True and policy.kernels_default(h200(), cpu)[0] is False
    assert policy.packed_attention_default(False) == (
        True,
        "per-document SDPA reference; documents never attend to each other",
    )
    value, reason = policy.moe_grouping_default()
    assert value is True and "searchsorted" in reason and "stable sort" in reason and "bincount" not in reason
    assert (
        policy.offload_default(
            gb10(), policy.budget_for("cuda", gb10()), policy.Sizer(None, 1024, 16, 1024), "lora16", 8192, True
        )[0]
        == "off"
    )
    assert policy.machine_warnings("cuda", no_gpu(), policy.budget_for("cuda", no_gpu()))
    assert policy.training_mode(True, "float32") == "qlora4"
    assert policy.training_mode(False, "float32") == "lora32"
    assert policy.training_mode(False, "bfloat16") == "lora16"


def test_format_profile_text():
    text = format_profile(h200(), config_for("Qwen/Qwen3-8B"), qwen3_8b())
    assert "datacenter" in text and "NVIDIA H200" in text and "9.0" in text
    assert "training.offload = off" in text and "model.dtype = bfloat16" in text
    assert "memory.budget = " in text
    assert "estimate" in text
    cpu_text = format_profile(no_gpu())  # the demo config
    assert "kind       cpu" in cpu_text and "training.device = cpu" in cpu_text


# -- the real machine --------------------------------------------------------------------------


def test_detect_on_this_machine():
    import torch

    p = detect()
    assert isinstance(p, HardwareProfile)
    assert p.ram_total > 0 and 0 < p.ram_available <= p.ram_total and p.cpu_count >= 1
    assert p.torch_version == torch.__version__
    assert p.os and p.arch
    if not torch.cuda.is_available():
        assert p.kind == "cpu" and p.gpu_count == 0
        assert apply_defaults(RunConfig(), p).training.device == "cpu"
    json.dumps(p.to_dict())
    assert "Hardware" in format_profile(p)


def test_import_does_not_load_torch():
    # The studio imports engine.hardware before its window opens; torch must wait for detect().
    code = "import sys, engine.hardware; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reasons_travel_with_the_config_through_yaml(tmp_path):
    from engine.config import RunConfig
    from engine.hardware.policy import explain_defaults

    cfg = apply_defaults(config_for(), profile_from_properties(None))
    assert set(cfg.auto_reasons) == set(cfg.auto_fields)
    path = tmp_path / "c.yaml"
    cfg.save(path)
    again = RunConfig.load(path)
    lines = explain_defaults(again)
    assert any("per-document SDPA" in line for line in lines)


# -- device-wide memory ------------------------------------------------------------------------

MEMINFO = """MemTotal:       125402112 kB
MemFree:         3145728 kB
MemAvailable:   104857600 kB
Buffers:          524288 kB
Cached:         98566144 kB
HugePages_Total:       0
"""


def test_unified_memory_is_read_from_the_os(tmp_path):
    from engine.hardware.vram import device_memory, os_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    m = device_memory(unified=True, meminfo=meminfo)
    assert m.source == "os"
    assert m.total == 125402112 * 1024
    # Used is what the OS cannot give back: the page cache counts as available.
    assert m.used == (125402112 - 104857600) * 1024
    assert m.free == 104857600 * 1024 and 0 < m.fraction < 0.2
    assert os_memory(meminfo) == m


def test_os_memory_without_meminfo_asks_psutil(tmp_path):
    import psutil

    from engine.hardware.vram import os_memory

    m = os_memory(tmp_path / "missing")
    assert m.source == "os" and m.total == psutil.virtual_memory().total and 0 < m.used <= m.total


def test_device_memory_on_this_machine():
    import torch

    from engine.hardware.vram import device_memory

    m = device_memory(0)
    if torch.cuda.is_available():
        assert m is not None and m.source in ("nvml", "cuda") and 0 < m.used <= m.total
    else:
        try:
            import pynvml  # noqa: F401
        except ImportError:
            assert m is None  # no GPU, no NVML: nothing to show


def test_vram_module_does_not_load_torch():
    code = "import sys, engine.hardware.vram as v; v.device_memory(0); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
