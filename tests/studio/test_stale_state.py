"""Nothing stays from a previous state (issue 14 item 6): banners clear when the model or the data
changes and are re-set only by the new state; memory badges and fast paths go back to "—" for a
model that cannot be read; Chat and Export pick the run that just ended; the ETA goes with the run."""

from __future__ import annotations

import pytest
from studio_helpers import short_config

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"  # not in the test cache, and HF_HUB_OFFLINE=1: unreadable


def _data_ready(dp) -> bool:
    return dp.preview is not None and not dp.loading


def test_data_banner_clears_when_switching_back_to_the_demo_model(window, qtbot):
    dp, mp = window.data_panel, window.model_panel
    qtbot.waitUntil(lambda: _data_ready(dp) and dp.example is not None, timeout=60_000)
    assert dp.banner.text() == ""

    mp.choose(QWEN)
    qtbot.waitUntil(lambda: "Cannot load the tokenizer" in dp.banner.text(), timeout=60_000)
    assert "Qwen" in dp.banner.text() or "Qwen" in mp.banner.text()

    dp.example = None
    mp.choose("demo")
    qtbot.waitUntil(lambda: dp.example is not None and dp.layout_info is not None, timeout=60_000)
    assert dp.banner.text() == "", dp.banner.text()
    assert "Cannot load the tokenizer" not in dp.packing_stats.text()


def test_data_banner_clears_when_the_data_changes(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: _data_ready(dp), timeout=60_000)
    with qtbot.waitSignal(dp.failed, timeout=60_000):
        dp.load_source(str(tmp_path / "missing.jsonl"))
    assert "does not exist" in dp.banner.text()
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source("demo")
    assert dp.banner.text() == ""


def test_folder_banner_clears_when_a_hub_id_is_typed(window, qtbot, tmp_path):
    mp = window.model_panel
    qtbot.waitUntil(lambda: mp.report is not None, timeout=60_000)
    with qtbot.waitSignal(mp.report_ready, timeout=60_000):
        mp.choose(str(tmp_path / "no_such_model"))
    assert "does not exist" in mp.banner.text()

    edit = mp.hub_id.lineEdit()
    edit.clear()
    qtbot.keyClicks(edit, "Qwen/Qwen2.5-0.5B")
    assert mp.hub.isChecked()
    assert mp.banner.text() == ""

    # Reading it (offline) says why it cannot, not that a folder is missing.
    with qtbot.waitSignal(mp.report_ready, timeout=60_000):
        mp._use_clicked()
    assert "does not exist" not in mp.banner.text()
    assert mp.banner.text()


def test_memory_badges_and_fast_paths_clear_for_an_unreadable_model(window, qtbot, tmp_path):
    mp = window.model_panel
    qtbot.waitUntil(lambda: mp.report is not None, timeout=60_000)
    window.state.profile_changed.emit(window.state.profile)  # any profile: verdicts get filled
    qtbot.waitUntil(lambda: any(v.text() != "—" for _n, v in mp.vram_labels.values()), timeout=60_000)
    assert mp.fast_paths.text() != "—"

    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{ this is not json", encoding="utf-8")
    with qtbot.waitSignal(mp.report_ready, timeout=60_000) as got:
        mp.choose(str(broken))
    assert got.args == [None]
    assert mp.banner.text()
    for need, verdict in mp.vram_labels.values():
        assert verdict.text() == "—" and need.text() == "—"
        assert verdict.property("tone") == "muted"
    assert mp.fast_paths.text() == "—"


def test_chat_and_export_pick_the_newest_run_and_the_eta_goes(window, qtbot, runs_dir):
    qtbot.waitUntil(lambda: window.engine_warm and _data_ready(window.data_panel), timeout=120_000)
    cp, ep, m = window.chat_panel, window.export_panel, window.monitor_panel

    dirs = []
    for name in ("first", "second"):
        short_config(window.state, runs_dir, name, steps=3)
        with qtbot.waitSignal(window.run_finished, timeout=240_000) as done:
            assert window.start_training()
        dirs.append(str(done.args[0].run_dir))
        assert m.eta.text() == ""
        # Chat and Export point at the run that just finished (its final adapter).
        assert cp.source.currentData() == dirs[-1], (cp.source.currentData(), dirs)
        assert ep.selected_source() == dirs[-1]
    assert dirs[0] != dirs[1]


def test_eta_clears_after_stop(window, qtbot, runs_dir):
    qtbot.waitUntil(lambda: window.engine_warm and _data_ready(window.data_panel), timeout=120_000)
    m = window.monitor_panel
    short_config(window.state, runs_dir, "stopped", steps=5000)
    with qtbot.waitSignal(window.run_finished, timeout=240_000) as done:
        assert window.start_training()
        qtbot.waitUntil(lambda: "ETA" in m.eta.text(), timeout=120_000)
        window.stop()
    assert done.args[0].stopped
    assert m.eta.text() == "" and m.eta.toolTip() == ""
    # Chat offers the stopped run's newest checkpoint.
    assert str(done.args[0].run_dir) in window.chat_panel.source.currentData()


def test_model_page_says_what_runs_on_this_machine(window, qtbot):
    """Issue 14 item 10: the Model page and the Train page agree. On a machine without CUDA the
    kernels, the fused LoRA and the fused CE are off (the torch references run) and 4-bit QLoRA
    needs CUDA; a switch turned off in the config reads off with its key."""
    mp = window.model_panel
    qtbot.waitUntil(lambda: mp.report is not None and window.state.profile is not None, timeout=60_000)
    mp.refresh()
    qtbot.waitUntil(lambda: mp.report is not None and "fused LoRA MLP" in mp.fast_paths.text(), timeout=60_000)
    if window.state.profile.kind != "cpu":
        pytest.skip("a CUDA machine runs the fast paths")
    text = mp.fast_paths.text()
    assert "fused LoRA MLP</b>: off on this machine: no CUDA GPU" in text
    assert "RMSNorm kernel</b>: off on this machine" in text
    assert mp.vram_labels["qlora4"][1].text() == "needs CUDA"
    window.state.set("fast_paths.packed_attention", False)
    assert "packed varlen attention</b>: off: fast_paths.packed_attention is false" in mp.fast_paths.text()
