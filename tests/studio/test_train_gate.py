"""Train is enabled only when the model can load and the data holds a usable example; the
reason shows beside the button. A failed run is one sentence in the window, its traceback in
the run's log.txt behind Details, and the sidebar marks say what really happened."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from studio_helpers import short_config


def _demo_dir() -> Path:
    from engine.api import DEMO_MODEL_DIR

    return Path(DEMO_MODEL_DIR)


def _gate(window):
    page = window.training_panel
    return page.train.isEnabled(), page.train_reason.text(), page.train.toolTip()


def test_unusable_rows_disable_train_with_the_reason(window, qtbot, tmp_path):
    from studio.main_window import DATA

    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None and not dp.loading, timeout=60_000)
    assert window.training_panel.train.isEnabled()

    bad = tmp_path / "empty_replies.jsonl"
    bad.write_text(
        "".join(json.dumps({"instruction": f"q{i}", "output": ""}) + "\n" for i in range(3)), encoding="utf-8"
    )
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source(str(bad))
    enabled, reason, tip = _gate(window)
    assert not enabled
    assert "None of the 3 rows can be used" in reason and reason in tip
    assert window.training_panel.train_reason.isVisibleTo(window.training_panel)
    assert not window.train_action.isEnabled()
    assert window.steps.state(DATA) == "failed"
    assert not window.start_training()  # the window refuses too, and says why
    assert "None of the 3 rows" in window.training_panel.banner.text()

    # Columns that match no shape: × as well.
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"foo": "a", "bar": "b"}\n', encoding="utf-8")
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source(str(wrong))
    assert not window.training_panel.train.isEnabled()
    assert "columns" in window.training_panel.train_reason.text()
    assert window.steps.state(DATA) == "failed"

    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source("demo")
    enabled, reason, _tip = _gate(window)
    assert enabled and reason == ""
    assert window.train_action.isEnabled()
    assert window.steps.state(DATA) == "done"


def test_model_folder_without_weights_disables_train(window, qtbot, tmp_path):
    from studio.main_window import MODEL

    folder = tmp_path / "config_only"
    folder.mkdir()
    shutil.copy(_demo_dir() / "config.json", folder / "config.json")

    mp = window.model_panel
    qtbot.waitUntil(lambda: mp.report is not None, timeout=60_000)
    with qtbot.waitSignal(mp.report_ready, timeout=60_000):
        mp.choose(str(folder))
    enabled, reason, tip = _gate(window)
    assert not enabled
    assert "no weights" in reason and "tokenizer" not in reason.split("no weights")[0], reason
    assert "no weights" in tip
    assert not window.train_action.isEnabled()
    assert not window.start_training()
    # The Model page says × and why, and no "fits" for a model that cannot load.
    assert window.steps.state(MODEL) == "failed"
    assert mp.banner.isVisibleTo(mp) and "no weights" in mp.banner.text()
    assert all(verdict.text() != "fits" for _need, verdict in mp.vram_labels.values())

    with qtbot.waitSignal(mp.report_ready, timeout=60_000):
        mp.choose("demo")
    enabled, reason, _tip = _gate(window)
    assert enabled and reason == ""
    assert window.train_action.isEnabled()
    assert window.steps.state(MODEL) == "done"


def test_check_model_folder_lists_each_problem(tmp_path):
    from engine.api import check_model_folder

    assert check_model_folder(str(_demo_dir())) == []
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    problems = check_model_folder(str(tmp_path))
    assert len(problems) == 2 and "no weights" in problems[0] and "tokenizer" in problems[1]
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    assert "pickle" in check_model_folder(str(tmp_path))[0]
    assert check_model_folder(str(tmp_path), allow_pickle=True) == []


def test_a_failed_run_is_one_sentence_with_details_in_log_txt(window, qtbot, tmp_path, runs_dir):
    from studio.main_window import MONITOR, TRAIN

    # Looks complete (config, weights, tokenizer), so Train is allowed; the weights are garbage.
    folder = tmp_path / "broken_weights"
    shutil.copytree(_demo_dir(), folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")

    mp, dp = window.model_panel, window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None and not dp.loading, timeout=60_000)
    with qtbot.waitSignal(mp.report_ready, timeout=60_000):
        mp.choose(str(folder))
    assert window.training_panel.train.isEnabled(), window.training_panel.train_reason.text()
    short_config(window.state, runs_dir, "broken", steps=3)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    with qtbot.waitSignal(window.run_finished, timeout=120_000) as done:
        assert window.start_training()
    event = done.args[0]
    assert type(event).__name__ == "Failed"
    assert "Traceback" in event.detail

    m = window.monitor_panel
    log = m.log.toPlainText()
    assert "Traceback" not in log and 'File "' not in log, log
    assert "ERROR" in log
    assert m.banner.isVisibleTo(m) and "\n" not in m.banner.text() and "Traceback" not in m.banner.text()
    assert "Traceback" not in m.status.text()
    assert m.progress.text() != "0 / 1 steps"
    # Details opens the run's log.txt, which holds the traceback.
    assert m.details.isVisibleTo(m) and m.details_path
    assert Path(m.details_path).name.endswith("log.txt")
    assert "Traceback" in Path(m.details_path).read_text(encoding="utf-8")
    assert window.pages.currentIndex() == MONITOR
    assert window.steps.state(TRAIN) == "failed" and window.steps.state(MONITOR) == "failed"
    assert window.training_panel.train.isEnabled()  # a fixed model can be tried again
