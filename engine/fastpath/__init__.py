"""The fast paths around the big matmuls: fused LoRA Functions and their adapter-weight cache
(lora.py), 4-bit base access (quant.py), packed-sequence metadata (packed.py), packed
attention dispatch (attention.py), offloaded checkpointing (offload.py), MoE grouping
(moe.py), the embedding table in host memory (host_embed.py; a tied head streams it through the
loss, host_head.py) and the MLP over tiles of tokens (tiled_mlp.py). Each has a stock path it
falls back to, and learns like it (tests/gpu/test_learning_gpu.py).
The Triton kernels they call live in engine.kernels."""
