"""The Data page on files the detector cannot map by itself: the rows stay browsable, the
person maps the columns in the editor, and the example and packing views follow. Parquet and
CSV load like JSONL; a local model folder works offline as well as the bundled name."""

from __future__ import annotations

import pandas as pd


def test_column_mapping_editor_fixes_an_unknown_shape(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    path = tmp_path / "pairs.csv"
    pd.DataFrame(
        {"q": [f"What is {i} plus 1?" for i in range(50)], "a": [f"Answer: {i + 1}" for i in range(50)]}
    ).to_csv(path, index=False)
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source(str(path))
    assert dp.rows_model.total_rows == 50  # browsable even though the shape is unknown
    assert dp.banner.level == "error" and "map them" in dp.banner.text()

    dp.mapping.set_mapping("instruction", {"instruction": "q", "output": "a"})
    with qtbot.waitSignal(dp.packing_ready, timeout=60_000):
        dp.mapping.apply.click()
    assert window.state.get("data.columns") == {"instruction": "q", "output": "a"}
    assert window.state.get("data.format") == "instruction"
    qtbot.waitUntil(lambda: dp.mask_view.num_trained > 0, timeout=60_000)
    assert "Answer" in dp.mask_view.text.toPlainText()
    assert dp.packing_view.num_rows > 0


def test_parquet_loads_like_jsonl(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    path = tmp_path / "chat.parquet"
    pd.DataFrame(
        {
            "messages": [
                [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]
                for i in range(20)
            ]
        }
    ).to_parquet(path)
    with qtbot.waitSignal(dp.packing_ready, timeout=60_000):
        dp.load_source(str(path))
    assert dp.preview.format.kind == "conversations"
    assert dp.rows_model.total_rows == 20
    assert "hello 0" in dp.rows_model.data(dp.rows_model.index(0, 0))


def test_local_model_folder_reports_like_the_demo(window, qtbot):
    from engine.resources import DEMO_MODEL_DIR

    mp = window.model_panel
    mp.folder.setText(str(DEMO_MODEL_DIR))
    mp.local.setChecked(True)
    with qtbot.waitSignal(
        mp.report_ready,
        timeout=60_000,
        check_params_cb=lambda rep: rep is not None and rep["name"] == str(DEMO_MODEL_DIR),
    ):
        mp.use.click()
    assert mp.fields["layers"].text() == "4"
    assert window.state.get("model.name_or_path") == str(DEMO_MODEL_DIR)


def test_a_downloaded_hub_data_set_folder_with_subsets(window, qtbot, tmp_path):
    """A folder as `huggingface-cli download --repo-type dataset` leaves it, with two subsets declared in
    its README: without a subset the banner names them and the box that picks one; with one it loads."""
    import json

    root = tmp_path / "sums"
    for subset, n in (("main", 12), ("socratic", 5)):
        (root / subset).mkdir(parents=True)
        rows = [{"question": f"{subset}: what is {i} + 1?", "answer": f"Answer: {i + 1}"} for i in range(n)]
        (root / subset / "train-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train-*\n"
            for s in ("main", "socratic")
        )
        + "---\n"
    )
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    dp.file.setChecked(True)
    dp.path.setText(str(root))
    with qtbot.waitSignal(dp.failed, timeout=60_000):
        dp.load_button.click()
    assert "several subsets (main, socratic)" in dp.banner.text() and "Subset box" in dp.banner.text()

    dp.subset.setText("socratic")
    with qtbot.waitSignal(dp.packing_ready, timeout=60_000):
        dp.load_button.click()
    assert window.state.get("data.subset") == "socratic" and window.state.get("data.source") == str(root)
    assert dp.rows_model.total_rows == 5 and dp.preview.format.kind == "instruction"
    assert "socratic: what is 0 + 1?" in dp.rows_model.data(dp.rows_model.index(0, 0))
