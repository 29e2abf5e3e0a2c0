"""The user's path on transformers families nobody here wrote an architecture file for, on the CPU.

For each family: a tiny random-weight folder built from transformers' own config class (the demo
tokenizer beside it), then what a person does with it: `tunesmith train` (4 steps on the demo
data), `tunesmith export --merged` and `--gguf` (each self-checked against the trained model), and
a chat reply through engine.chat. Every step runs as its own process, as a person would run it, so
a crash in one (llama.cpp aborts, say) is recorded as that step's exit code.

    python scripts/family_sweep.py OUT_DIR [FAMILY ...]     (default: every family below)

Writes OUT_DIR/sweep.md (one row per family) and each step's log beside it. Nothing is
downloaded: the weights are random and the tokenizer is the demo's, so a converter that needs a
family's own tokenizer files (tokenizer.model, special tokens) fails here for that reason alone.
docs/family-sweep.md keeps the last results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "resources" / "demo_model"
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    max_position_embeddings=1024,
    pad_token_id=0,
    eos_token_id=2,
    bos_token_id=1,
)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)
# What a family's config needs beyond BASE to build small (experts, latent attention).
EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(**_ROUTED, **_MLA, n_group=1, topk_group=1),
    "deepseek_v3": dict(**_ROUTED, **_MLA, n_group=1, topk_group=1),
    "glm4_moe": dict(**_ROUTED, n_group=1, topk_group=1),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
}
FAMILIES = [
    "apertus", "bitnet", "cohere2", "deepseek_v2", "deepseek_v3", "doge", "ernie4_5", "ernie4_5_moe",
    "exaone4", "falcon_mamba", "glm", "glm4", "glm4_moe", "granitemoeshared", "helium", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "jetmoe", "llama4_text", "minimax", "mixtral", "nemotron", "olmo", "olmoe", "persimmon",
    "phimoe", "recurrent_gemma", "seed_oss", "smollm3", "stablelm",
]  # fmt: skip
CHAT = """
import sys
from engine.chat import generate_reply, load_chat_model
from engine.config import RunConfig
cfg = RunConfig.load(sys.argv[1] + "/config.yaml")
model, tok = load_chat_model(cfg.model, sys.argv[1])
print("reply:", repr(generate_reply(model, tok, "What is 7 plus 5?", max_new_tokens=8)))
"""


def build(family: str, folder: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**BASE, **EXTRA.get(family, {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO / name, folder / name)
    return type(model).__name__


def step(out: Path, name: str, cmd: list[str]) -> str:
    """Run one step as its own process; its outcome in a table cell."""
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.startswith(("error:", "reply:"))), "")
    cell = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    return f"{cell} ({time.time() - start:.0f} s){': ' + said[:160] if said else ''}".replace("|", "\\|")


def sweep(out: Path, families: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tunesmith = [sys.executable, "-m", "engine"]
    rows = {}
    for family in families:
        fam = out / family
        shutil.rmtree(fam, ignore_errors=True)
        fam.mkdir()
        try:
            arch = build(family, fam / "model")
        except Exception as exc:  # a config this transformers cannot build small
            rows[family] = [f"not built: {type(exc).__name__}: {str(exc)[:120]}"]
            continue
        config = {
            "model": {"name_or_path": str(fam / "model")},
            "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
            "data": {"source": "demo", "max_seq_len": 256},
            "training": {"max_steps": 4, "rows_per_micro_batch": 2, "save_every": 4, "log_every": 1},
            "output": {"dir": str(fam), "run_name": "run"},
        }
        (fam / "run.yaml").write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
        cells = [arch, step(fam, "train", [*tunesmith, "train", str(fam / "run.yaml")])]
        if cells[-1].startswith("ok"):
            run = str(fam / "run")
            cells.append(step(fam, "merged", [*tunesmith, "export", run, "--merged", str(fam / "merged")]))
            cells.append(step(fam, "gguf", [*tunesmith, "export", run, "--gguf", str(fam / "model.gguf")]))
            cells.append(step(fam, "chat", [sys.executable, "-c", CHAT, run]))
        rows[family] = cells
        print(family, " | ".join(cells), flush=True)
    head = "| family | class | train | export --merged | export --gguf | chat |\n|---|---|---|---|---|---|\n"
    body = "".join(f"| {f} | " + " | ".join(c) + " |\n" for f, c in rows.items())
    (out / "sweep.md").write_text(head + body, encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sweep(Path(sys.argv[1]), sys.argv[2:] or FAMILIES)
