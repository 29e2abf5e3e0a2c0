"""SmolLM3: Llama's layer where some layers skip RoPE (NoPE: the module's `use_rope` is False, from
`no_rope_layers`), which the patched attention honours per module, and an optional sliding window."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "smollm3",
    HFClasses.with_prefix("SmolLM3"),
    fast_paths=True,
    fused_add_norm=True,
    sliding_window="module",
    # The second of the two layers without RoPE (as every fourth layer of the real model);
    # ids inside the tiny vocabulary.
    tiny=dict(no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2),
)
