"""Library noise is filtered where it starts (issue 28, item 11): the window's warm-up imports do not
print bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community", and an example
longer than the tokenizer's model_max_length (which the engine cuts itself) does not draw
transformers' "Token indices sequence length is longer than …"."""

from __future__ import annotations

import subprocess
import sys

from child_process import child_env

WARM = """
import logging
logging.basicConfig(level=logging.WARNING)
from engine.api import warm_up
warm_up()
print("WARM", flush=True)
"""


def test_warm_up_imports_quietly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", WARM],
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "WARM" in out.stdout, out.stderr
    assert "gemm_4bit_forward" not in out.stderr, out.stderr


def test_a_long_example_draws_no_token_length_warning(capfd):
    from engine.api import RunConfig, load_tokenizer

    tok = load_tokenizer(RunConfig.from_dict({}).model)
    capfd.readouterr()
    # transformers' loggers write to stderr through their own handler (they do not propagate).
    ids = tok("word " * (tok.model_max_length + 50))["input_ids"]
    assert len(ids) > tok.model_max_length
    assert "Token indices sequence length" not in capfd.readouterr().err
