"""Which model types may pack several documents into one row, and why the others run each alone.

A packed row keeps its documents apart only where every layer does: the attention through the
engine's packed function (engine.fastpath.attention, which reads cu_seqlens) or through masks
transformers builds from the documents' positions, and no layer that carries state from one token
to the next (Arch.row_state). Which families do that is a fact about transformers' code that no
config.json states, so it is a list: `PACKED_ROWS_CHECKED`, each entry checked by
tests/engine/models/test_packing.py (a packed row's loss equals each document's through the stock
forward, to 1e-5). Most of them keep the documents apart on their stock attention too (the masks
transformers builds from the positions); those in `STOCK_MASKS_MIX` do so only through the engine's
packed attention, and run each document alone when it is off (fast_paths.packed_attention: false, or
a model it refuses). Every other model type, one nobody here has named included, runs each document
of a packed row as its own forward (engine.train.step): slower, and the same loss as the stock
model's. Plain data, no torch import: the memory policy reads it before anything loads.
"""

from __future__ import annotations

from typing import Optional

# Families checked to keep packed documents apart (beyond transformers' aliases listed with them).
PACKED_ROWS_CHECKED: frozenset[str] = frozenset(
    {
        # With engine/models/arch files.
        "arcee",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "exaone4",
        "falcon",
        "falcon_h1",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt2",
        "gpt_bigcode",
        "gpt_neox",
        "gpt_oss",
        "gptj",
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "hyperclovax",
        "llama",
        "minicpm3",
        "ministral",
        "mistral",
        "olmo2",
        "olmo3",
        "opt",
        "phi",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "starcoder2",
        # transformers' own classes, no file of ours.
        "afmoe",
        "apertus",
        "apertus1p5_text",
        "aria_text",
        "biogpt",
        "bitnet",
        "codegen",
        "ctrl",
        "cwm",
        "dbrx",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v4",
        "diffllama",
        "dory",
        "dots1",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "gemma3n_text",
        "gemma4_text",
        "gemma4_unified_text",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "gpt_neox_japanese",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "internlm3",
        "iquestcoder",
        "jais2",
        "jetmoe",
        "kolibri1",
        "laguna",
        "llama4_text",
        "longcat_flash",
        "mellum",
        "mimo_v2_flash",
        "minimax_m2",
        "ministral3",
        "mixtral",
        "nanochat",
        "nemotron",
        "olmo",
        "olmoe",
        "phimoe",
        "sarvam_moe",
        "seed_oss",
        "solar_open",
        "stablelm",
        "vaultgemma",
        "youtu",
    }
)

# Checked families whose stock attention lets packed documents see each other (its masks ignore
# the documents' positions): apart only through the engine's packed attention. Checked by
# tests/engine/models/test_packing.py with the packed attention off.
STOCK_MASKS_MIX: frozenset[str] = frozenset({"afmoe", "biogpt", "gpt_oss", "opt"})

# Families seen to let packed documents see each other, with what does it (for the run's report).
_SEEN_LEAKING: dict[str, str] = {
    "bloom": "its ALiBi attention builds its mask from the whole row, not the documents' positions",
}


def documents_alone(model_type: Optional[str], packed_attention: bool = True) -> Optional[str]:
    """Why each document of a packed row must run as its own forward for `model_type` (a phrase
    about the family: "its layers carry state along a row", ...), or None where packed rows keep
    their documents apart (also for a model whose type is not known yet). `packed_attention`:
    whether the engine's packed attention runs the model's attention (the default a run gets)."""
    if not model_type:
        return None
    from engine.models.arch import arch_for  # the package imports this module's names lazily

    arch = arch_for(model_type)
    if arch is not None and arch.row_state:
        return "its layers carry state along a row"
    if model_type in PACKED_ROWS_CHECKED:
        if not packed_attention and model_type in STOCK_MASKS_MIX:
            return "its stock attention lets packed documents see each other, and the engine's packed attention is off"
        return None
    if model_type in _SEEN_LEAKING:
        return _SEEN_LEAKING[model_type]
    return "it is not a family the engine has checked keeps the documents of a packed row apart"
