"""The GPU learning-parity tier: every fast-path combination the engine can choose learns like
the stock HF + PEFT path over 30 optimizer steps, in bf16, on real layer shapes.

Each case trains a local model folder (random weights from a public config's shape, a few
layers, the demo tokenizer) on learnable plain-text documents (engine.data.synthetic) through
the real TrainingSession, once with the fast path under test and once on the stock path
(every fast path off, the unfused optimizer), on the same rows in the same order. It passes
when the stock curve falls by at least 0.5 nats, ours falls by the same amount within 10%,
every step is within 2% of the stock curve and the final loss within 1%; and when the fast
paths it asked for really ran (counted per step) with no fallback to the stock modules.

The training methods (DPO, ORPO, SimPO, KTO, GRPO) each run with a 16-bit and a 4-bit base,
offload off and double (test_method_learns_like_stock): the same comparison on the demo's
preference pairs, with each method's own fall (its loss has its own scale); GRPO, whose loss is
no progress measure and whose samples part ways in bf16, compares the rise of its reward.

Every curve is appended to $TUNESMITH_LEARNING_LOG (docs/gpu-test-log.md keeps the last run's).

Run on the GPU host:  python -m pytest -m gpu tests/gpu/test_learning_gpu.py -q
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from learning_parity import compare, curve_table, make_config, random_model_folder, stock, train  # noqa: E402

from engine.data.synthetic import write_text_jsonl  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 30
SEQ = 4096
LR = 1e-3
BF16 = dict(step_rel=0.02, final_rel=0.01, min_fall=0.5, fall_rel=0.10)

# Layer shapes of public configs (WORKLOADS.md), with fewer layers and the demo tokenizer's
# vocabulary so each run takes seconds.
SHAPES = {
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        max_position_embeddings=131_072,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=2,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        tie_word_embeddings=False,
        max_position_embeddings=131_072,
    ),
    # SmolLM3-3B's layer: the second layer has no RoPE (NoPE, as every fourth of the real model's).
    "smollm3": dict(
        model_type="smollm3",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        no_rope_layers=[1, 0],
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        max_position_embeddings=65_536,
    ),
    # Ministral-8B's layer, a sliding window short enough to cut the 4,096-token rows.
    "ministral": dict(
        model_type="ministral",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=100_000_000.0,
        max_position_embeddings=32_768,
    ),
    # AFM-4.5B's layer: Llama's attention over a plain up -> ReLU² -> down MLP (kept stock).
    "arcee": dict(
        model_type="arcee",
        hidden_size=2560,
        intermediate_size=18432,
        num_hidden_layers=2,
        num_attention_heads=20,
        num_key_value_heads=4,
        head_dim=128,
        hidden_act="relu2",
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        max_position_embeddings=65_536,
    ),
    # OLMo-3-7B's layer: norms after attention and the MLP, q/k norms over the whole projections,
    # a window short enough to cut the 4,096-token rows on its sliding layer.
    "olmo3": dict(
        model_type="olmo3",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=500_000.0,
        max_position_embeddings=65_536,
    ),
    # EXAONE-4.0-1.2B's layer: a sliding layer (RoPE, a window that cuts the rows) and a global NoPE layer.
    "exaone4": dict(
        model_type="exaone4",
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        max_position_embeddings=65_536,
    ),
    # Gemma-3-1B's layer: (1 + w) norms before and after attention and the MLP, per-head q/k norms,
    # one query group, 256-wide heads; a sliding layer (its own rotary base) with a window that cuts
    # the rows, then a full one.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=32_768,
    ),
}

# Llama's shape with its own output head: the input table may move to host memory.
SHAPES["llama_untied"] = dict(SHAPES["llama"], tie_word_embeddings=False)

_LOG = os.environ.get("TUNESMITH_LEARNING_LOG")


def _log(name: str, named, problems) -> None:
    if not _LOG:
        return
    with open(_LOG, "a", encoding="utf-8") as f:
        verdict = "PASS" if not problems else "FAIL: " + "; ".join(problems)
        f.write(f"\n### {name}: {verdict}\n\n```\n{curve_table(named)}\n```\n")


def _model_folder(root: Path, arch: str) -> Path:
    """A local Hugging Face folder: random bf16 weights of `arch`'s shape and the demo tokenizer."""
    spec = dict(SHAPES[arch])
    return random_model_folder(root / arch, spec.pop("model_type"), **spec)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("learning")


@pytest.fixture(scope="module")
def data(root):
    return {
        "short": write_text_jsonl(root / "short.jsonl", 1500, seed=0),
        # Documents of a few thousand tokens: long enough for the offloader to keep attention
        # outputs for the recompute.
        "long": write_text_jsonl(root / "long.jsonl", 60, seed=1, words_per_doc=(1500, 2500)),
    }


_REFS: dict = {}


def _reference(cfg):
    """The stock run of `cfg` (cached: cases that differ only in fast paths share it)."""
    ref = stock(cfg)
    key = json.dumps({k: v for k, v in ref.to_dict().items() if k != "output"}, sort_keys=True, default=str)
    if key not in _REFS:
        _REFS[key] = train(ref)
    return _REFS[key]


def _case(root, data, arch, fast=None, data_kind="short", **training):
    folder = _model_folder(root, arch)
    name = "-".join([arch] + [f"{k}={v}" for k, v in {**(fast or {}), **training}.items()])
    cfg = make_config(
        str(folder),
        data[data_kind],
        root / "runs" / name,
        steps=STEPS,
        seq=SEQ if data_kind == "short" else 8192,
        lr=LR,
        fast=fast,
        **training,
    )
    return name, cfg


def _fast_paths_ran(ours, expected: tuple[str, ...]) -> list[str]:
    """Requested fast paths that did not run on every step, and any fallback to stock modules.

    An expected name matches a counter key exactly ("rmsnorm:triton") or its prefix ("moe").
    """
    problems = []
    for s in ours.steps:
        calls, fallbacks = s.fast_path_calls, s.fallbacks
        missing = [k for k in expected if not any((c == k or c.split(":")[0] == k) and n > 0 for c, n in calls.items())]
        if missing:
            problems.append(f"step {s.step}: {missing} did not run (calls: {calls})")
            break
        if fallbacks:
            problems.append(f"step {s.step}: fallbacks to the stock path: {fallbacks}")
            break
    return problems


def _offload_on(ours, cfg) -> list[str]:
    """An offload case must really have offloaded (it is off without checkpointing)."""
    mode = cfg.training.offload
    if mode not in ("single", "double"):
        return []
    got = ours.fast_report.get("offload", "")
    return [] if got.startswith(f"on: {mode}") else [f"offload {mode} was asked for, the run says {got!r}"]


def _check(name, ours, ref, expected=(), cfg=None):
    problems = compare(ours, ref, **BF16) + _fast_paths_ran(ours, expected)
    if cfg is not None:
        problems += _offload_on(ours, cfg)
    _log(name, {"stock": ref, "ours": ours}, problems)
    assert not problems, f"{name}:\n" + "\n".join(problems) + "\n" + curve_table({"stock": ref, "ours": ours})


FUSED = ("lora_linears", "lora_mlp")
KERNELS = ("rmsnorm:triton", "rope:triton", "activations:triton")
CE, ATTN = ("fused_ce:triton",), ("attention:varlen_triton",)
ALL = FUSED + KERNELS + CE + ATTN
QK = ("qk_norm_rope:triton",)  # per-head q/k norms fused with RoPE (Qwen3, EXAONE-4, Gemma-3)
STACK = ("stacked_gemm",)  # gate and up as one base GEMM (fast_paths.stacked_bases)
FOLD = ("folded_gemm",)  # q/k/v's and gate/up's LoRA inside their base GEMMs (fast_paths.fold_lora)

# (arch, fast-path overrides, training overrides, fast paths that must have run every step)
CASES = [
    ("qwen3", {}, {}, ALL + QK + STACK + FOLD),  # the defaults a GPU run gets
    ("qwen3", {"qk_norm_rope": False}, {}, ALL),
    ("qwen3", {"stacked_bases": False}, {}, ALL + QK + FOLD),
    ("qwen3", {"fold_lora": False}, {}, ALL + QK + STACK),
    ("qwen3", {}, {"optimizer": "adamw_fused"}, ALL),
    ("qwen3", {}, {"optimizer": "adamw"}, ALL),
    ("qwen3", {"kernels": False}, {}, FUSED + CE + ATTN),
    ("qwen3", {"lora_autograd": False}, {}, ("rmsnorm:triton", "rope:triton") + CE + ATTN),
    ("qwen3", {"fused_ce": False}, {}, FUSED + KERNELS + ATTN),
    ("qwen3", {"packed_attention": False}, {}, FUSED + KERNELS + CE),
    ("qwen3", {"cached_metadata": False}, {}, ALL),
    # Small models train without checkpointing on an H200 by default: these turn it on, with
    # the offload variants on top.
    ("qwen3", {}, {"gradient_checkpointing": True, "offload": "off"}, ALL),
    ("qwen3", {}, {"gradient_checkpointing": True, "offload": "single"}, ALL),
    ("qwen3", {}, {"gradient_checkpointing": True, "offload": "double"}, ALL + QK + STACK + FOLD),
    ("qwen3", {}, {"grad_accum": 2, "rows_per_micro_batch": 1}, ALL),
    ("llama", {}, {}, ALL + STACK + FOLD),
    ("llama", {}, {"gradient_checkpointing": True, "offload": "double"}, ALL),
    ("llama_untied", {"host_embeddings": True}, {}, ALL),
    # Llama-3.2's tied table on the host: the loss streams it (engine.fastpath.host_head).
    ("llama", {"host_embeddings": True}, {}, FUSED + KERNELS + ("fused_ce:streamed",) + ATTN),
    ("smollm3", {}, {}, ALL),
    ("ministral", {}, {}, ALL),
    ("arcee", {}, {}, ("lora_linears", "rmsnorm:triton", "rope:triton") + CE + ATTN),
    ("olmo3", {}, {}, ALL),
    ("exaone4", {}, {}, ALL + QK),
    ("gemma3_text", {}, {}, ALL + QK),
    # Gemma's embedding module scales its rows: the host table must too (its tied head streams).
    ("gemma3_text", {"host_embeddings": True}, {}, FUSED + KERNELS + ("fused_ce:streamed",) + ATTN),
]


@pytest.mark.parametrize(
    "arch,fast,training,expected",
    CASES,
    ids=["-".join([a] + [f"{k}={v}" for k, v in {**f, **t}.items()]) or a for a, f, t, _ in CASES],
)
def test_fast_path_learns_like_stock(root, data, arch, fast, training, expected):
    name, cfg = _case(root, data, arch, fast, **training)
    ours = train(cfg)
    _check(name, ours, _reference(cfg), expected, cfg)
    if fast.get("host_embeddings") is True:
        assert ours.fast_report.get("host_embeddings", "").startswith("on: "), ours.fast_report


@pytest.mark.parametrize("kind", ["plain", "offload-lean-tiled", "untied"])
def test_qlora_nf4_learns_like_stock_qlora(root, data, kind):
    pytest.importorskip("bitsandbytes")
    w7 = kind == "offload-lean-tiled"
    if w7:  # W7's settings on long rows: single offload, the lean recompute standing in for the tiled MLP
        fast = {"tiled_mlp": True, "lean_recompute": True}
        name, cfg = _case(root, data, "llama", fast, data_kind="long", gradient_checkpointing=True, offload="single")
    else:  # untied: auto moves a 4-bit base's untied table to host memory from the start
        name, cfg = _case(root, data, "llama_untied" if kind == "untied" else "qwen3")
    cfg.model.load_in_4bit = True
    name += "-nf4"
    ours = train(cfg)
    _check(name, ours, _reference(cfg), ALL, cfg if w7 else None)
    if w7:
        assert ours.fast_report.get("lean_recompute", "").startswith("on"), ours.fast_report
    if kind == "untied":
        assert ours.fast_report.get("host_embeddings", "").startswith("on: auto"), ours.fast_report


# GPT-OSS's attention has sinks, which our varlen kernel takes (its rows pack since 2026-12-03);
# its LoRA projections run PEFT's stock path by design (no attention patch).
@pytest.mark.parametrize(
    "arch,expected", [("qwen3_moe", ("moe", "lora_linears") + CE), ("gpt_oss", ("moe",) + CE + ATTN)]
)
def test_moe_grouping_learns_like_stock(root, data, arch, expected):
    name, cfg = _case(root, data, arch)
    ours = train(cfg)
    _check(name, ours, _reference(cfg), expected)


def test_kept_attention_on_long_documents_learns_like_stock(root, data):
    name, cfg = _case(
        root, data, "llama", {"keep_attention": True}, data_kind="long", gradient_checkpointing=True, offload="double"
    )
    ours = train(cfg)
    _check(name, ours, _reference(cfg), ALL, cfg)
    notes = [s.offload for s in ours.steps]
    assert any("kept" in n for n in notes), f"attention outputs were never kept: {notes[:3]}"


@pytest.mark.parametrize("lean", [False, True])
def test_tiled_mlp_on_long_documents_learns_like_stock(root, data, lean):
    # 8,192-token rows against Llama's 4,096-token tiles (intermediate 8,192): two tiles a
    # row, each recomputed in the backward, inside offloaded checkpointing. With the lean recompute
    # (auto's choice from hidden size 4,096, as on W7) LoRAMLPUnread stands in for the tiled MLP.
    fast = {"tiled_mlp": True, "lean_recompute": lean}
    name, cfg = _case(root, data, "llama", fast, data_kind="long", gradient_checkpointing=True, offload="single")
    ours = train(cfg)
    _check(name, ours, _reference(cfg), ALL, cfg)
    assert ours.fast_report.get("tiled_mlp", "").startswith("on: tiles of 4,096 tokens"), ours.fast_report
    assert ours.fast_report.get("lean_recompute", "").startswith("on" if lean else "off"), ours.fast_report


def test_stop_and_resume_mid_run_learns_like_an_uninterrupted_stock_run(root, data):
    name, cfg = _case(root, data, "qwen3", optimizer="adamw_fused")
    name += "-stop-resume"
    first = train(cfg, stop_after=12)
    assert len(first.losses) == 12
    second = train(cfg, resume_from=first.run_dir)
    ours = type(first)(first.losses + second.losses, second.adapter, first.steps + second.steps)
    _check(name, ours, _reference(cfg), ALL)


def test_tunesmith_train_on_a_local_folder_learns_like_stock(root, data):
    """The user's path: `tunesmith train CONFIG --output RUN` (the CLI in its own process, every
    setting "auto") on a local model folder and a learnable JSONL; its metrics.jsonl curve
    against the stock HF + PEFT run of the same config."""
    import subprocess

    name, cfg = _case(root, data, "qwen3")
    cfg.training.optimizer = "auto"
    out = root / "cli-run"
    cfg_file = root / "cli.yaml"
    cfg.save(cfg_file)
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(cfg_file), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e["event"] == "StepMetrics"]
    started = next(e for e in events if e["event"] == "RunStarted")
    assert started["fast_paths"]["lora_mlp"].startswith("on"), started["fast_paths"]
    ref = _reference(cfg)
    from learning_parity import Curve

    ours = Curve(losses, {})
    problems = compare(ours, ref, **BF16)
    _log("tunesmith train (CLI), " + name, {"stock": ref, "cli": ours}, problems)
    assert not problems, "\n".join(problems) + "\n" + curve_table({"stock": ref, "cli": ours})


# -- training methods: each x (16-bit, 4-bit base) x (offload off, double) -------------------------

METHODS = ("dpo", "orpo", "simpo", "kto", "grpo")
# The smallest fall of the stock curve that tells a learning run from a flat one, in each loss's
# own scale: DPO starts at log 2, SimPO near 1 (beta 2, gamma 0.5) and moves with per-token mean
# log-probs (slowly), ORPO carries the chosen answers' NLL, KTO starts at 0.5 and is bounded by 1.
METHOD_MIN_FALL = {"dpo": 0.1, "orpo": 0.3, "simpo": 0.05, "kto": 0.03}
METHOD_EXPECTED = FUSED + KERNELS + ("token_logp:triton",) + ATTN  # the log-probs leave through the fused head
# Preference losses approach 0 (DPO's fell from 0.69 to 0.02 in 30 steps at the SFT cases' 1e-3
# on the CPU): there a 2% step bound would hold bf16 rounding of a tiny number. At 3e-4 the
# curves fall a few tenths and stay well above 0. GRPO keeps the SFT cases' 1e-3.
METHOD_LR = 3e-4
# GRPO's reward: the completion starts with a digit. About 1 in 10 of the demo tokenizer's tokens
# does, so on random weights some completions of a group of 8 score and most do not (the
# advantages are not all zero), and the policy can learn to start with one.
GRPO_REWARD = r"(?s)\d.*"
GRPO_MIN_RISE = 0.05  # mean reward of the last 10 steps over the first 10 (the stock run's)


def _method_data(root: Path, method: str) -> Path:
    from tests.engine.train.test_methods_session import write_pairs, write_prompts, write_unpaired

    write = {"kto": write_unpaired, "grpo": write_prompts}.get(method, write_pairs)
    path = root / f"{method}.jsonl"
    return path if path.exists() else write(path)


def method_case(root: Path, method: str, quant: str, offload: str):
    """(name, config) of a method's case on Qwen3's layer shape, 30 steps on the demo's rows: 4
    packed rows of 256 tokens a step (about 20 pairs or KTO answers; GRPO: 4 prompts x a group
    of 8, 8 new tokens each)."""
    training = {"method": method}
    if offload != "off":
        training.update(gradient_checkpointing=True, offload=offload)
    name = f"qwen3-{method}-{quant}-offload={offload}"
    cfg = make_config(
        str(_model_folder(root, "qwen3")),
        _method_data(root, method),
        root / "runs" / name,
        steps=STEPS,
        seq=256,
        rows=4,
        lr=LR if method == "grpo" else METHOD_LR,
        **training,
    )
    cfg.data.format = "auto"  # the preference and prompt formats are detected from the columns
    cfg.model.load_in_4bit = quant == "nf4"
    if method == "grpo":
        from engine.config import RewardConfig

        cfg.grpo.group_size, cfg.grpo.max_new_tokens, cfg.grpo.beta = 8, 8, 0.04
        cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=GRPO_REWARD)]
    return name, cfg


def _rewards(curve) -> list[float]:
    return [s.metrics["reward"] for s in curve.steps]


def _rise(curve) -> float:
    r = _rewards(curve)
    return sum(r[-10:]) / 10 - sum(r[:10]) / 10


def method_problems(name, method, ours, ref, cfg) -> list[str]:
    """Why `ours` does not learn `method` like the stock run `ref` (empty: it does)."""
    if method != "grpo":
        problems = compare(ours, ref, **dict(BF16, min_fall=METHOD_MIN_FALL[method]))
    else:
        # Sampling from bf16 logits parts the two runs' completions from the first step on, so
        # their losses cannot be held step by step: both must learn the reward, ours as well.
        problems = [] if len(ours.steps) == STEPS else [f"{len(ours.steps)} steps of {STEPS}"]
        if _rise(ref) < GRPO_MIN_RISE:
            problems.append(f"the stock run's reward rose {_rise(ref):.3f} only (< {GRPO_MIN_RISE}): {_rewards(ref)}")
        if _rise(ours) < 0.5 * _rise(ref):
            problems.append(f"reward rose {_rise(ours):.3f}, the stock run's {_rise(ref):.3f}: {_rewards(ours)}")
    return problems + _fast_paths_ran(ours, METHOD_EXPECTED) + _offload_on(ours, cfg)


@pytest.mark.parametrize("offload", ["off", "double"])
@pytest.mark.parametrize("quant", ["16bit", "nf4"])
@pytest.mark.parametrize("method", METHODS)
def test_method_learns_like_stock(root, method, quant, offload):
    if quant == "nf4":
        pytest.importorskip("bitsandbytes")
    name, cfg = method_case(root, method, quant, offload)
    # Checkpointing and offload change no math: the offload-off case's stock run serves both.
    ours, ref = train(cfg), _reference(method_case(root, method, quant, "off")[1])
    problems = method_problems(name, method, ours, ref, cfg)
    _log(name, {"stock": ref, "ours": ours}, problems)
    assert not problems, f"{name}:\n" + "\n".join(problems) + "\n" + curve_table({"stock": ref, "ours": ours})
