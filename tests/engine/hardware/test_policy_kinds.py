"""The kind of machine drives the defaults (issue 15 item 1): injected profiles of a 4060 Laptop
8 GB, a 4090 Laptop 16 GB, a 4090 desktop 24 GB, an H200 and a GB10 with and without the
integrated flag get different, reasoned budgets, 4-bit choices, offload and micro-batches; and on
the W8 laptop caps the micro-batch grows until the estimate fills the budget."""

from __future__ import annotations

import pytest

from engine.config import RunConfig
from engine.hardware import policy
from engine.hardware.policy import KIND_RULES, budget_for, memory_budget, resolve_defaults
from engine.hardware.profile import GiB, GpuProperties, MiB, emulated_card, profile_from_properties
from engine.models.estimate import model_info

# -- the machines ------------------------------------------------------------------------------


def laptop_4060():
    # 8 GB card with the desktop already on it: about 0.8 GiB in use.
    return profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4060 Laptop GPU", 8188 * MiB, (8, 9), free_memory=7400 * MiB),
        os_name="Windows",
        arch="AMD64",
        ram_total=32 * GiB,
    )


def laptop_4090():
    return profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4090 Laptop GPU", 16376 * MiB, (8, 9), free_memory=15400 * MiB),
        ram_total=64 * GiB,
    )


def desktop_4090():
    return profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4090", 24564 * MiB, (8, 9), free_memory=23800 * MiB), ram_total=64 * GiB
    )


def h200():
    return profile_from_properties(
        GpuProperties("NVIDIA H200", 143771 * MiB, (9, 0), free_memory=143000 * MiB), ram_total=256 * GiB
    )


def gb10(integrated: bool):
    # cudaMemGetInfo under-reports on unified memory (60 GiB); the OS says 100 GiB are available.
    return profile_from_properties(
        GpuProperties("NVIDIA GB10", int(119.7 * GiB), (12, 1), integrated=integrated, free_memory=60 * GiB),
        arch="aarch64",
        cpu_count=20,
        ram_total=int(119.7 * GiB),
        ram_available=100 * GiB,
    )


def qwen3(hidden, inter, layers, heads, tied):
    return model_info(
        dict(
            model_type="qwen3",
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=tied,
        )
    )


QWEN3_06B = qwen3(1024, 3072, 28, 16, True)
QWEN3_17B = qwen3(2048, 6144, 28, 16, True)
QWEN3_4B = qwen3(2560, 9728, 36, 32, True)
QWEN3_8B = qwen3(4096, 12288, 36, 32, False)
QWEN3_14B = qwen3(5120, 17408, 40, 40, False)
LLAMA_3B = model_info(
    dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
    )
)


def config(seq=1024, **training):
    cfg = RunConfig()
    cfg.model.name_or_path = "example/not-cached-model"  # the shapes come from model_info
    cfg.data.max_seq_len = seq
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return cfg


def decide(profile, info, **kw):
    d = resolve_defaults(config(**kw), profile, info)
    return d, d.config


def tokens(cfg):
    return cfg.training.rows_per_micro_batch * cfg.data.max_seq_len


# -- kinds and budgets -------------------------------------------------------------------------


def test_each_machine_gets_its_kind():
    assert laptop_4060().kind == "rtx_laptop" and laptop_4090().kind == "rtx_laptop"
    assert desktop_4090().kind == "rtx_desktop"
    assert h200().kind == "datacenter"
    assert gb10(True).kind == "dgx_spark" and gb10(False).kind == "dgx_spark"


def test_gb10_name_implies_unified_memory_without_the_flag():
    flagless = gb10(integrated=False)
    assert flagless.integrated_memory, "a GB10 shares memory with the host whatever the driver says"
    assert "did not report integrated memory" in flagless.kind_reason
    assert "did not report" not in gb10(True).kind_reason
    # Both budget against the OS's available memory, not cudaMemGetInfo's 60 GiB.
    for p in (gb10(True), flagless):
        budget, reason = memory_budget("cuda", p)
        assert budget.where == "unified memory" and budget.free == 100 * GiB
        assert 90 * GiB < budget.memory < 100 * GiB
        assert "OS reports" in reason and "share unified memory" in reason


def test_gb10_with_and_without_the_flag_decide_the_same():
    with_flag, cfg_a = decide(gb10(True), QWEN3_8B)
    without, cfg_b = decide(gb10(False), QWEN3_8B)
    assert cfg_a.to_dict() == cfg_b.to_dict()
    for d, cfg in ((with_flag, cfg_a), (without, cfg_b)):
        # Never offload to "host": it is the same memory.
        assert cfg.training.offload == "off"
        assert "unified memory" in d.choices["training.offload"][1]
        assert cfg.model.load_in_4bit is False


def test_laptop_leaves_more_display_headroom_than_a_desktop():
    # The same 16 GB card, measured equally free, as a laptop part and as a desktop part.
    free = 15400 * MiB
    laptop = profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4090 Laptop GPU", 16376 * MiB, (8, 9), free_memory=free)
    )
    desktop = profile_from_properties(GpuProperties("NVIDIA GeForce RTX 4080", 16376 * MiB, (8, 9), free_memory=free))
    lb, lr = memory_budget("cuda", laptop)
    db, dr = memory_budget("cuda", desktop)
    assert lb.free == db.free == free
    assert lb.memory < db.memory < free  # both leave a margin; the laptop's is larger
    assert free - lb.memory >= KIND_RULES["rtx_laptop"].margin_min
    assert "desktop and browser" in lr and "RTX laptop" in lr
    assert "display" in dr and "RTX desktop" in dr
    # The budget is measured free memory less the margin: what the desktop uses now is not planned on.
    busy = profile_from_properties(
        GpuProperties("NVIDIA GeForce RTX 4060 Laptop GPU", 8188 * MiB, (8, 9), free_memory=5000 * MiB)
    )
    assert budget_for("cuda", busy).memory < 5000 * MiB
    assert any("other programs use" in w for w in resolve_defaults(config(), busy, QWEN3_06B).warnings)


def test_datacenter_budget_is_nearly_the_whole_free_card():
    budget, reason = memory_budget("cuda", h200())
    assert budget.free - budget.memory < 3 * GiB and "no display" in reason


# -- 4-bit loading -----------------------------------------------------------------------------


def test_consumer_cards_prefer_4bit_above_a_size_that_crowds_the_micro_batch():
    # A 4B model on 12 GB: 16-bit fits one row, but leaves no room for a busy micro-batch. The
    # laptop goes to 4 bits; a datacenter card of the same size keeps 16 bits (it fits).
    laptop12 = profile_from_properties(GpuProperties("NVIDIA GeForce RTX 4080 Laptop GPU", 12 * GiB, (8, 9)))
    dc12 = profile_from_properties(GpuProperties("NVIDIA A10G", 12 * GiB, (8, 6)))
    d_l, cfg_l = decide(laptop12, QWEN3_4B)
    d_d, cfg_d = decide(dc12, QWEN3_4B)
    assert cfg_l.model.load_in_4bit is True
    assert "RTX laptop" in d_l.choices["model.load_in_4bit"][1]
    assert f"micro-batch of {policy.BUSY_TOKENS} tokens" in d_l.choices["model.load_in_4bit"][1]
    assert cfg_d.model.load_in_4bit is False
    assert "4-bit only when 16-bit does not fit" in d_d.choices["model.load_in_4bit"][1]
    # Small models stay 16-bit on a laptop: they leave room for the micro-batch.
    assert decide(laptop_4060(), QWEN3_06B)[1].model.load_in_4bit is False


def test_8b_goes_4bit_on_laptops_and_stays_16bit_on_big_cards():
    assert decide(laptop_4060(), QWEN3_8B)[1].model.load_in_4bit is True
    assert decide(laptop_4090(), QWEN3_8B)[1].model.load_in_4bit is True
    d, cfg = decide(desktop_4090(), QWEN3_8B)
    assert cfg.model.load_in_4bit is False, d.choices["model.load_in_4bit"][1]
    assert decide(h200(), QWEN3_8B)[1].model.load_in_4bit is False
    assert decide(gb10(False), QWEN3_8B)[1].model.load_in_4bit is False


# -- offload -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [laptop_4060, laptop_4090, desktop_4090])
def test_consumer_cards_offload(make):
    d, cfg = decide(make(), QWEN3_8B)
    assert cfg.training.gradient_checkpointing is True
    assert cfg.training.offload in ("single", "double")
    assert "host RAM" in d.choices["training.offload"][1]


def test_datacenter_skips_offload_when_the_step_fits():
    d, cfg = decide(h200(), QWEN3_8B)
    assert cfg.training.gradient_checkpointing is True and cfg.training.offload == "off"
    assert "fits without offload" in d.choices["training.offload"][1]


def test_datacenter_offloads_when_the_step_does_not_fit_without_it():
    # An 8B model in 16 bits on a 24 GB datacenter card: weights ~15 GiB; the checkpointed layer
    # inputs of a busy micro-batch do not fit beside them without offload.
    l4 = profile_from_properties(GpuProperties("NVIDIA L4", 23034 * MiB, (8, 9)))
    assert l4.kind == "datacenter"
    d, cfg = decide(l4, QWEN3_8B)
    assert cfg.model.load_in_4bit is False
    assert cfg.training.offload in ("single", "double")
    assert "without offload" in d.choices["training.offload"][1]


# -- micro-batches -----------------------------------------------------------------------------


def test_micro_batches_grow_with_the_kind():
    laptop = tokens(decide(laptop_4090(), QWEN3_06B)[1])
    desktop = tokens(decide(desktop_4090(), QWEN3_06B)[1])
    dc = tokens(decide(h200(), QWEN3_06B)[1])
    assert laptop <= KIND_RULES["rtx_laptop"].max_tokens
    assert desktop <= KIND_RULES["rtx_desktop"].max_tokens
    assert dc == KIND_RULES["datacenter"].max_tokens > desktop
    assert KIND_RULES["datacenter"].max_tokens > KIND_RULES["rtx_laptop"].max_tokens


def test_decisions_differ_where_they_should():
    seen = {}
    for name, make in [
        ("4060 Laptop", laptop_4060),
        ("4090 Laptop", laptop_4090),
        ("4090", desktop_4090),
        ("H200", h200),
        ("GB10", lambda: gb10(True)),
        ("GB10 no flag", lambda: gb10(False)),
    ]:
        d, cfg = decide(make(), QWEN3_8B)
        t = cfg.training
        seen[name] = (cfg.model.load_in_4bit, t.offload, tokens(cfg))
        # Every choice carries its reason, and the budget note says what it was measured from.
        assert all(reason for _, reason in d.choices.values())
        assert "memory.budget" in d.notes
        assert d.verdict in ("fits", "tight"), (name, d.warnings)
    assert seen["4060 Laptop"][0] is True and seen["4090"][0] is False
    assert seen["4090 Laptop"][1] != "off" and seen["H200"][1] == "off" and seen["GB10"][1] == "off"
    assert seen["GB10"] == seen["GB10 no flag"]
    assert seen["4060 Laptop"][2] < seen["4090 Laptop"][2] < seen["H200"][2]


# -- not too timid: the W8 laptop caps ---------------------------------------------------------

CARDS = {
    6: "NVIDIA GeForce RTX 4050 Laptop GPU",
    8: "NVIDIA GeForce RTX 4060 Laptop GPU",
    12: "NVIDIA GeForce RTX 4080 Laptop GPU",
    16: "NVIDIA GeForce RTX 4090 Laptop GPU",
}
W8 = [
    (QWEN3_17B, None, [6, 8, 12, 16]),
    (LLAMA_3B, None, [6, 8, 12, 16]),
    (QWEN3_4B, True, [6, 8, 12, 16]),
    (QWEN3_8B, True, [8, 12, 16]),  # its 4-bit weights alone are ~5.8 GiB: not on a 6 GiB card
    (QWEN3_14B, True, [16]),
]


@pytest.mark.parametrize(
    "info, qlora, caps", W8, ids=["qwen3-1.7b", "llama-3.2-3b", "qwen3-4b-q", "qwen3-8b-q", "14b-q"]
)
def test_laptop_caps_fill_the_budget(info, qlora, caps):
    """The micro-batch grows until the (pessimistic) estimate fills the budget, or to the
    laptop's ceiling: the 70%-of-cap goal of issue 15 is measured on the GPU (bench/laptop.py);
    here the plan aims at it."""
    for cap in caps:
        p = profile_from_properties(GpuProperties(CARDS[cap], cap * GiB, (8, 9)), ram_total=64 * GiB)
        cfg = config(seq=1024)
        if qlora:
            cfg.model.load_in_4bit = True
        d = resolve_defaults(cfg, p, info)
        budget = budget_for("cuda", p)
        at_ceiling = tokens(d.config) >= KIND_RULES["rtx_laptop"].max_tokens
        one_row = d.config.training.rows_per_micro_batch == 1
        assert d.estimate <= cap * GiB or one_row, (cap, d.explain())
        if not (at_ceiling or one_row):
            assert d.estimate >= 0.7 * cap * GiB, (cap, d.explain())
            assert d.estimate <= budget.memory
            # One more row would not fit: the budget is full.
            more = policy.Sizer(info, 1024, cfg.lora.r, d.config.fast_paths.ce_chunk_tokens)
            t = d.config.training
            bigger = more(
                policy.training_mode(d.config.model.load_in_4bit, "bfloat16"),
                tokens(d.config) + 1024,
                t.gradient_checkpointing,
                t.offload,
            )
            assert bigger > budget.memory


def test_emulated_card_setting():
    assert emulated_card("NVIDIA GeForce RTX 4060 Laptop GPU:8") == ("NVIDIA GeForce RTX 4060 Laptop GPU", 8 * GiB)
    assert emulated_card("Card: with colon:7.5") == ("Card: with colon", int(7.5 * GiB))
    for bad in (None, "", "no size", "name:", ":8", "name:-1", "name:x"):
        assert emulated_card(bad) is None, bad


def test_fsdp_sizes_each_device_for_its_shard_of_the_base():
    """A Llama-3.1-70B-shaped 16-bit base (~131 GiB) leaves no room on one H200: with 2 processes the
    policy picks FSDP and sizes each GPU for half the base plus two gathered layers, so the fit
    check no longer says "will not fit" and the micro-batch is not starved."""
    llama70 = model_info(
        dict(
            model_type="llama",
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            tie_word_embeddings=False,
        )
    )
    cfg = config(seq=4096)
    cfg.model.load_in_4bit = False
    one = resolve_defaults(cfg, h200(), llama70)
    two = resolve_defaults(cfg, h200(), llama70, world_size=2)
    assert one.config.training.distributed == two.config.training.distributed == "fsdp"
    assert one.verdict == "will not fit" and two.verdict != "will not fit", (one.verdict, two.verdict)
    # The room the shards free goes to the micro-batch.
    rows = (one.config.training.rows_per_micro_batch, two.config.training.rows_per_micro_batch)
    assert rows[1] > rows[0], rows
    assert "memory.sharded" in two.notes and "memory.sharded" not in one.notes
