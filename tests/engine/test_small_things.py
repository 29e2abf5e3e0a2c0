"""Issue 14, item 11 (engine side): empty configs, an output path that is a file, data files
that are not UTF-8 or hold NUL bytes, file permissions of what is published, "1 row" rather
than "1 rows", and third-party noise while models load."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engine import runs
from engine.config import ConfigError, DataConfig, RunConfig
from engine.data import plural
from engine.data.sources import DataError, load_raw
from engine.runs import RunFolder, RunFolderError, publish


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout)


# -- 1. an empty config is an error, not a run on all defaults -----------------------------------
@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n"])
def test_empty_config_is_refused_naming_the_file(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty: "):
        RunConfig.load(path)


def test_empty_config_on_the_command_line(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    out = cli("train", str(path))
    assert out.returncode == 2
    assert "empty.yaml is empty" in out.stderr and "Traceback" not in out.stderr


# -- 2. --output naming a file ------------------------------------------------------------------
def test_check_free_refuses_a_file(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(RunFolderError, match=r"^the output must be a folder, but .*notes\.txt is a file$"):
        RunFolder(afile).check_free()
    with pytest.raises(RunFolderError, match=r"must be a folder, but .*notes\.txt is a file"):
        RunFolder(afile / "run").check_free()
    RunFolder(tmp_path / "new" / "run").check_free()  # missing folders are fine


def test_train_output_that_is_a_file_says_so(tmp_path):
    afile = tmp_path / "out.txt"
    afile.write_text("x")
    from engine.resources import DEMO_PRESET

    out = cli("train", str(DEMO_PRESET), "--output", str(afile), "--max-steps", "1")
    assert out.returncode == 1
    assert f"the output must be a folder, but {afile} is a file" in out.stderr
    assert "NotADirectoryError" not in out.stderr and "Traceback" not in out.stderr


# -- 3. bytes that are not UTF-8, NUL bytes ----------------------------------------------------
def _load(path: Path):
    return load_raw(DataConfig(source=str(path)))


def test_jsonl_not_utf8_names_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        _load(path)
    msg = str(err.value)
    assert "latin1.jsonl is not UTF-8 text" in msg and "line 2, column 14" in msg and "0xe9" in msg
    assert "byte 2" not in msg


def test_json_list_not_utf8_names_line(tmp_path):
    path = tmp_path / "list.json"
    path.write_bytes(b'[\n{"text": "ok"},\n{"text": "\xff"}\n]\n')
    with pytest.raises(DataError, match=r"list\.json is not UTF-8 text: line 3, column 11"):
        _load(path)


def test_csv_not_utf8_names_line_and_column(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes("text\nfine\nna\u00efve\n".encode("utf-8") + b"caf\xe9\n")
    with pytest.raises(DataError, match=r"rows\.csv is not UTF-8 text: line 4, column 4"):
        _load(path)


def test_utf16_with_bom_is_named(tmp_path):
    path = tmp_path / "wide.jsonl"
    path.write_text('{"text": "ok"}\n', encoding="utf-16")
    with pytest.raises(DataError, match=r"UTF-16 byte order mark\): line 1, column 1"):
        _load(path)


def test_nul_bytes_in_jsonl_are_named(tmp_path):
    path = tmp_path / "wide.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' + '{"text": "ok"}\n'.encode("utf-16-le"))
    with pytest.raises(DataError) as err:
        _load(path)
    assert str(err.value) == f"{path} line 2 contains NUL bytes (\\x00): the file may be binary or UTF-16"


def test_nul_bytes_in_json_and_csv_are_named(tmp_path):
    path = tmp_path / "nul.json"
    path.write_bytes(b'[{"text": "ok"},\n{"text": "a\x00b"}]')
    with pytest.raises(DataError, match=r"nul\.json line 2 contains NUL bytes"):
        _load(path)
    path = tmp_path / "nul.csv"
    path.write_bytes(b"text\nok\n\x00\x00\n")
    with pytest.raises(DataError, match=r"nul\.csv line 3 contains NUL bytes"):
        _load(path)


def test_good_csv_still_loads(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text("text\nna\u00efve caf\u00e9\n", encoding="utf-8")
    assert _load(path)[0]["text"] == "na\u00efve caf\u00e9"


# -- 4. published files get the umask's permissions, not 0600 ----------------------------------
@pytest.fixture
def umask():
    def set_(mask):
        os.umask(mask)

    old = os.umask(0o022)
    yield set_
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_publish_gives_files_normal_permissions(tmp_path, umask):
    import numpy as np
    from safetensors.numpy import save_file

    for mask, want in ((0o022, 0o644), (0o027, 0o640)):
        umask(mask)
        tmp, final = tmp_path / f"a{mask}.tmp", tmp_path / f"a{mask}"
        (tmp / "sub").mkdir(parents=True)
        save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp / "adapter_model.safetensors"))
        (tmp / "sub" / "state.json").write_text("{}")
        os.chmod(tmp / "sub" / "state.json", 0o600)
        publish(tmp, final)
        assert _mode(final / "adapter_model.safetensors") == want
        assert _mode(final / "sub" / "state.json") == want


def test_exported_adapter_files_are_0644(tmp_path, umask):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.export import run_exports
    from engine.resources import DEMO_MODEL_DIR

    run = tmp_path / "run"
    adapter = run / runs.ADAPTER
    (run / runs.CONFIG).parent.mkdir(parents=True)
    (run / runs.CONFIG).write_text("model:\n  name_or_path: demo\n")
    # A real adapter of the demo model (the export checks it against its base before writing).
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR), LoraConfig(r=4, lora_alpha=8))
    model.save_pretrained(adapter)
    for f in adapter.iterdir():
        os.chmod(f, 0o600)  # what safetensors writes
    run_exports(run, {"adapter": tmp_path / "out"})
    for f in (tmp_path / "out").iterdir():
        assert _mode(f) == 0o644, f


# -- 5. "1 row", not "1 rows" -------------------------------------------------------------------
def test_plural():
    assert plural(0, "row") == "0 rows"
    assert plural(1, "row") == "1 row"
    assert plural(2, "example") == "2 examples"
    assert plural(1, "more row", "more rows") == "1 more row"
    assert plural(3, "more row", "more rows") == "3 more rows"


def test_one_row_message(tmp_path):
    from engine.data.preview import render_example

    path = tmp_path / "one.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match=r"\(1 row\)$"):
        render_example(None, DataConfig(source=str(path)), 5)


# -- 6. third-party noise while a model loads --------------------------------------------------
def test_quiet_third_party_is_scoped(capsys):
    from transformers.utils import logging as hf_logging

    from engine.models.loading import quiet_third_party

    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    engine_log = logging.getLogger("engine.test_small_things")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party():
            assert not hf_logging.is_progress_bar_enabled()
            assert not hf_logging.get_logger("transformers.modeling_utils").isEnabledFor(logging.WARNING)
            assert not bnb.isEnabledFor(logging.WARNING)
            bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community")
            warnings.warn_explicit(
                "`is_gradient_checkpointing` is deprecated", FutureWarning, "modeling_utils.py", 1, "transformers.x"
            )
            warnings.warn_explicit("peft says", DeprecationWarning, "peft_model.py", 1, "peft.peft_model")
            # The engine's own messages still pass.
            warnings.warn_explicit("engine says", FutureWarning, "session.py", 1, "engine.train.session")
            assert engine_log.isEnabledFor(logging.WARNING)
        # Everything is back afterwards.
        assert hf_logging.is_progress_bar_enabled()
        assert hf_logging.get_verbosity() == logging.WARNING
        assert bnb.isEnabledFor(logging.WARNING)
        warnings.warn_explicit("after", FutureWarning, "modeling_utils.py", 2, "transformers.x")
    assert [str(w.message) for w in seen] == ["engine says", "after"]
    assert "gemm_4bit_forward" not in capsys.readouterr().err


def test_quiet_third_party_lets_errors_through():
    from engine.models.loading import quiet_third_party

    with pytest.raises(RuntimeError, match="boom"):
        with quiet_third_party():
            raise RuntimeError("boom")
    assert logging.getLogger("bitsandbytes").level == logging.NOTSET


def test_load_model_prints_no_third_party_noise():
    """A fresh interpreter loads the demo model and attaches LoRA as a training run does: no
    "Loading weights" bar, no bitsandbytes kernels-community notice, no FutureWarning."""
    code = (
        "import warnings; warnings.simplefilter('default')\n"
        "from engine.config import ModelConfig, LoraConfig\n"
        "from engine.models.loading import load_model, quiet_third_party\n"
        "from engine.models.lora import attach_lora\n"
        "m = load_model(ModelConfig(name_or_path='demo', load_in_4bit=False), 'cpu', 'float32')\n"
        "with quiet_third_party():\n"
        "    m = attach_lora(m, LoraConfig())\n"
        "print('loaded')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded" in out.stdout
    for noise in ("Loading weights", "kernels-community", "FutureWarning", "is_gradient_checkpointing"):
        assert noise not in out.stderr, out.stderr[-2000:]
