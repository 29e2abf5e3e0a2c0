"""Reference-workload benchmark harness (``python -m bench``).

Runs the workloads of WORKLOADS.md (W1-W7) for the Tunesmith engine ("ours") and its peers
(HF + PEFT with sdpa / flex_attention, + Liger, Unsloth) in one process on the same batches,
appends one JSON object per run to ``bench/results/results.jsonl`` and renders RESULTS.md.
The batches are learnable (bench.batches) and every record keeps its loss curve: a
speed of ours counts only when it learns like stock HF + PEFT in the same run (the learning
check, bench.report). Also: the 30-step learning check plus one step's gradients
against HF + PEFT (``--parity``), the 16 GiB longest-sequence search (``--memcap``) and a CPU
smoke run (``--cpu-smoke``).

Importing this package is cheap on purpose: the Unsloth child process must import unsloth
before transformers, so nothing here imports torch or transformers at module level.

Every bench process is ours, and its numbers are the engine's as the CLI runs it: the CUDA
allocator's setting (engine.allocator) is made here, before any bench module imports torch.
"""

from engine.allocator import prefer_expandable_segments

prefer_expandable_segments()
