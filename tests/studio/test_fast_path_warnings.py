"""The window says when a fast path did not run: the Monitor warns when a step's counted calls
miss a fast path the run asked for (or it ran on some layers only), and the Train and Model
pages say that LoRA dropout > 0 (the quality preset's 0.05) turns the fused LoRA path off."""

from __future__ import annotations

import pytest

REPORT = {
    "packed_attention": "on",
    "rmsnorm": "on",
    "rope": "on",
    "activations": "on",
    "lora_qkv": "on",
    "lora_o": "on",
    "lora_mlp": "on",
    "moe_grouping": "off: no MoE blocks in this model",
    "fused_ce": "on",
    "cached_metadata": "on",
    "offload": "off: disabled in config",
}
ALL_RAN = {
    "lora_linears": 16,
    "lora_mlp": 8,
    "rmsnorm:triton": 18,
    "rope:triton": 8,
    "activations:triton": 16,
    "attention:varlen_triton": 8,
    "fused_ce:triton": 2,
}


def _metrics(step, calls, fallbacks=None, device="cuda:0"):
    from engine.events import StepMetrics

    return StepMetrics(
        step=step,
        total_steps=10,
        epoch=0.1,
        loss=2.0,
        lr=1e-4,
        grad_norm=1.0,
        tokens=100,
        trained_tokens=90,
        step_seconds=0.1,
        tokens_per_second=1000.0,
        device=device,
        metadata_builds=2,
        fast_path_calls=calls,
        fallbacks=fallbacks or {},
    )


@pytest.fixture
def monitor(qtbot):
    from engine.events import RunStarted
    from studio.panels.monitor import MonitorPanel

    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.begin()
    panel.run_started(RunStarted("/tmp/run", {}, {"kind": "datacenter"}, 10, dict(REPORT)))
    yield panel
    panel.close()


def test_no_warning_when_every_requested_fast_path_ran(monitor):
    monitor.step(_metrics(1, dict(ALL_RAN)))
    assert monitor.banner.text() == "" and monitor.fast_path_warning == ""
    assert "lora_linears 16" in monitor.eta.toolTip()  # what ran, on hover


def test_warns_when_a_requested_fast_path_did_not_run(monitor):
    calls = {k: v for k, v in ALL_RAN.items() if k != "lora_mlp"}
    monitor.step(_metrics(1, calls))
    text = monitor.banner.text()
    assert monitor.banner.level == "warning"
    assert "lora_mlp did not run" in text and "Step 1" in text
    assert "lora_qkv" not in text
    assert "WARNING fast path lora_mlp was requested" in monitor.log.toPlainText()
    # The same problem next step: the log does not repeat it.
    monitor.step(_metrics(2, calls))
    assert monitor.log.toPlainText().count("fast path lora_mlp was requested") == 1


def test_warns_when_a_fast_path_ran_on_some_layers_only(monitor):
    monitor.step(_metrics(1, dict(ALL_RAN), {"lora_o: adapters disabled": 2}))
    text = monitor.banner.text()
    assert "lora_o ran on some layers only" in text and "adapters disabled (2x)" in text


def test_warns_when_a_gpu_ran_only_the_torch_reference(monitor):
    calls = {k: v for k, v in ALL_RAN.items() if k != "rmsnorm:triton"}
    calls["rmsnorm:torch"] = 18
    monitor.step(_metrics(1, calls))
    assert "rmsnorm ran its torch reference" in monitor.banner.text()
    # On a CPU the reference is the engine's path: nothing to warn about.
    monitor.banner.clear()
    monitor.begin()
    from engine.events import RunStarted

    monitor.run_started(RunStarted("/tmp/run", {}, {"kind": "cpu"}, 10, dict(REPORT)))
    cpu = {k.replace(":triton", ":torch").replace("varlen_triton", "reference"): v for k, v in ALL_RAN.items()}
    monitor.step(_metrics(1, cpu, device="cpu"))
    assert monitor.banner.text() == ""


def test_old_metrics_without_counts_warn_nothing(monitor):
    monitor.step(_metrics(1, {}))
    assert monitor.banner.text() == ""


def test_presets_say_dropout_turns_fused_lora_off():
    from studio import presets

    quality = presets.load_preset(presets.list_presets()["quality"])
    assert presets.lora_dropout(quality) == 0.05
    assert "turns the fused LoRA path off" in presets.dropout_note(0.05)
    assert presets.dropout_note(0.0) == ""
    listed = presets.with_dropout({"fused LoRA MLP": "on", "RMSNorm kernel": "on"}, 0.05)
    assert listed == {"fused LoRA MLP": "off with dropout > 0 (lora.dropout = 0.05)", "RMSNorm kernel": "on"}


def test_train_page_says_the_quality_preset_turns_fused_lora_off(window, qtbot):
    from studio.main_window import TRAIN

    window.go_to(TRAIN)
    page = window.training_panel
    page.apply_preset("quality")
    assert window.state.get("lora.dropout") == 0.05
    assert page.banner.level == "warning" and "turns the fused LoRA path off" in page.banner.text()
    qtbot.waitUntil(lambda: "fused LoRA: off with dropout > 0" in page.summary.text(), timeout=30_000)
    idx = page.preset.findText("quality")
    from PySide6.QtCore import Qt

    assert "turns the fused LoRA path off" in page.preset.itemData(idx, Qt.ItemDataRole.ToolTipRole)
    # The Model page's fast-path list follows the setting.
    mp = window.model_panel
    qtbot.waitUntil(lambda: bool(mp.report and mp.report.get("fast_paths")), timeout=60_000)
    qtbot.waitUntil(lambda: "fused LoRA MLP</b>: off with dropout > 0" in mp.fast_paths.text(), timeout=30_000)
    window.state.set("lora.dropout", 0.0)
    # Without dropout the fused path is back: on a GPU; a CPU runs the torch reference instead.
    expected = "off on this machine" if window.state.profile.kind == "cpu" else "on"
    assert f"fused LoRA MLP</b>: {expected}" in mp.fast_paths.text()
    page.validate()
    assert "fused LoRA" not in page.summary.text()
