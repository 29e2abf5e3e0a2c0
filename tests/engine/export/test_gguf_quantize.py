"""llama.cpp's quantizer failing is an export error that carries llama.cpp's own last line. Found by
the twenty-sixth session's family sweep (ExaoneMoe, transformers 5.25): the line was read after the
folder of its log had been removed, so the export said only "[Errno 2] No such file or directory:
'.../quantize.log'"."""

from __future__ import annotations

import logging

import pytest

from engine.export import ExportError
from engine.export import gguf as gguf_kind

MISSING = gguf_kind.missing()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"tunesmith[gguf] is not installed ({', '.join(MISSING)} missing)"
)


@pytest.mark.parametrize("after", ["nothing", "a quiet llama.cpp load"])
def test_a_failed_quantization_says_what_llama_cpp_said(tmp_path, after):
    # A `Llama(verbose=False)` (the GGUF self-check's, earlier in the same process: a second export
    # from the window) sets llama-cpp-python's logger to ERROR, which dropped the reason too.
    passed_on = logging.getLogger("llama-cpp-python")
    level = passed_on.level
    if after != "nothing":
        gguf_kind._llama_cpp()
        passed_on.setLevel(logging.ERROR)  # what llama_cpp._logger.set_verbose(False) does
    src, dst = tmp_path / "not-a-model.gguf", tmp_path / "model-q8_0.gguf"
    src.write_bytes(b"not a GGUF file")
    try:
        with pytest.raises(ExportError) as err:
            gguf_kind.quantize(src, dst, "q8_0")
    finally:
        passed_on.setLevel(level)
    said = str(err.value)
    assert "quantizer failed to make q8_0" in said and "failed to load model" in said, said
    assert not dst.exists()
    assert passed_on.level == level  # the block put the level back
