"""Model loading (demo, local folder, Hub id), 4-bit quantization, LoRA attach, and the
per-architecture patch registry that swaps in the fast paths."""
