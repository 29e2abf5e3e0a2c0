"""Runs page ▸ Continue with (issue 30): the SFT -> GRPO recipe (tests/engine/train/test_grpo_learning.py
does it through the config) as a click. On a real finished SFT run of the demo (the real
TrainingSession, 3 steps), "Continue with GRPO" lands on the Train page with the run's model and
settings, method grpo, lora.init_adapter naming the run's adapter and a new run name; the data
stays the person's to choose (the banner says so, and with DPO picked instead Train says why the
demo's instruction/answer rows are not DPO's data); with a prompts file chosen, Train trains a
GRPO run that starts from that adapter (its config.yaml and log say so). A run that failed before
its first save has the action disabled, with a tooltip saying why. A real window; waits for
signals, never times."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from PySide6.QtCore import Qt
from studio_helpers import screenshot
from test_runs_page import select, show_runs, train

from engine.config import RunConfig
from engine.events import Failed
from engine.train.faults import Faults
from engine.train.session import TrainingSession
from tests.engine.train.test_methods_session import config, run, write_prompts

pytestmark = pytest.mark.slow


# The runs are trained before the window exists (each test names its run fixture before `window`):
# beside the window's warm-up imports on a pool thread, an import in this thread can leave
# transformers half-imported ("module 'transformers' has no attribute 'PreTrainedTokenizerBase'",
# tests/studio/test_startup_race.py).
@pytest.fixture
def sft_run(tmp_path, runs_dir) -> Path:
    """A finished 3-step SFT run of the demo in the window's runs folder, with its final adapter."""
    cfg = config(tmp_path, "sft", "demo")
    cfg.output.run_name = "sft-run"
    result, _steps = run(cfg)
    folder = Path(result.run_dir)
    assert folder == runs_dir / "sft-run" and (folder / "adapter" / "adapter_model.safetensors").exists()
    return folder


def test_continue_with_grpo_sets_up_the_train_page_and_trains_from_the_runs_adapter(
    sft_run, window, qtbot, tmp_path, runs_dir
):
    from studio.main_window import TRAIN

    page = show_runs(window, qtbot)
    select(page, qtbot, ["sft-run"])
    assert page.continue_method.currentData() == "grpo"  # the recipe's method comes first
    assert page.continue_button.isEnabled()
    assert "A new GRPO run that starts from this run's adapter" in page.continue_button.toolTip()
    # The adapter it starts from is the one Chat and Export use: the best checkpoint by eval loss
    # first (the demo holds out examples), here the final adapter picked instead.
    assert page.selected_source() == str(sft_run / "checkpoints" / "step-3")
    assert page.select_source(str(sft_run))
    screenshot(window, "runs-continue-with")

    qtbot.mouseClick(page.continue_button, Qt.MouseButton.LeftButton)
    tp, state = window.training_panel, window.state
    assert window.pages.currentIndex() == TRAIN
    assert state.get("training.method") == "grpo" and tp.method.method() == "grpo"
    assert state.get("lora.init_adapter") == str(sft_run)
    assert state.get("output.run_name") == "auto"  # "sft-run" is taken
    # The run's model and settings, as its config.yaml has them.
    saved = RunConfig.load(sft_run / "config.yaml")
    assert state.get("model.name_or_path") == saved.model.name_or_path == "demo"
    for path in ("training.lr", "training.rows_per_micro_batch", "data.max_seq_len", "lora.r", "lora.alpha"):
        section, name = path.split(".")
        assert state.get(path) == getattr(getattr(saved, section), name), path
    assert state.get("grpo.rewards") == [{"kind": "regex", "pattern": r"Answer: .+"}]  # as picking GRPO gives
    text = tp.banner.text()
    assert "Continuing sft-run with GRPO" in text and str(sft_run) in text
    assert "Choose GRPO's data on the Data page: prompts" in text and "The data is still demo." in text
    screenshot(window, "train-continued-with-grpo")

    # DPO instead: the demo's instruction/answer rows are no pairs, and Train says so.
    select(show_runs(window, qtbot), qtbot, ["sft-run"])
    assert page.continue_selected("dpo")
    assert state.get("training.method") == "dpo" and state.get("lora.init_adapter") == str(sft_run)
    assert "Continuing sft-run with DPO" in tp.banner.text()
    qtbot.waitUntil(lambda: "DPO reads" in tp.train_reason.text(), timeout=120_000)
    assert not tp.train.isEnabled()

    # Back to GRPO, with a prompts file chosen on the Data page: it trains from the SFT adapter.
    select(show_runs(window, qtbot), qtbot, ["sft-run"])
    assert page.continue_selected("grpo")
    window.data_panel.load_source(str(write_prompts(tmp_path / "prompts.jsonl")))
    for path, value in (("training.max_steps", 2), ("grpo.group_size", 2), ("grpo.max_new_tokens", 4)):
        state.set(path, value)
    qtbot.waitUntil(lambda: not window.data_panel.loading and tp.train.isEnabled(), timeout=120_000)
    finished = train(window, qtbot)
    assert finished.summary["steps"] == 2
    new = Path(finished.run_dir)
    assert new != sft_run and new.parent == runs_dir
    cfg = yaml.safe_load((new / "config.yaml").read_text(encoding="utf-8"))
    assert cfg["training"]["method"] == "grpo" and cfg["lora"]["init_adapter"] == str(sft_run)
    assert f"LoRA starts from the adapter in {sft_run / 'adapter'}" in (new / "log.txt").read_text(encoding="utf-8")


@pytest.fixture
def failed_run(tmp_path, runs_dir) -> Path:
    """Every forward runs out of memory: the run fails at step 1, before any checkpoint or adapter."""
    cfg = config(tmp_path, "sft", "demo")
    cfg.output.run_name = "no-adapter"
    result = TrainingSession(cfg, lambda e: None, faults=Faults(oom_when=lambda a: not a["rehearsal"])).run()
    assert isinstance(result, Failed), result
    return runs_dir / "no-adapter"


def test_a_run_that_saved_no_adapter_cannot_be_continued(failed_run, window, qtbot):
    page = show_runs(window, qtbot)
    summary = page.summary("no-adapter")
    assert summary.status == "failed" and summary.adapter is None and not summary.checkpoints
    select(page, qtbot, ["no-adapter"])
    assert not page.continue_button.isEnabled()
    tip = page.continue_button.toolTip()
    assert tip.startswith("Cannot continue with GRPO: no-adapter saved no adapter"), tip
    assert "nothing to start from" in tip
    # Asked anyway (a shortcut, a script): refused in the page's banner, the Train page untouched.
    method = window.state.get("training.method")
    assert not page.continue_selected("kto")
    assert "Cannot continue with KTO: no-adapter saved no adapter" in page.banner.text()
    assert window.state.get("training.method") == method and not window.state.get("lora.init_adapter")


def test_a_run_whose_config_this_version_rejects_is_not_continued_and_the_train_page_says_why(sft_run, window, qtbot):
    # A config.yaml that reads as YAML but not as this version's config (a value it refuses).
    cfg = yaml.safe_load((sft_run / "config.yaml").read_text(encoding="utf-8"))
    cfg["training"]["lr"] = -1
    (sft_run / "config.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    before = dict(window.state.data["training"]), dict(window.state.data["lora"])
    page = show_runs(window, qtbot)
    select(page, qtbot, ["sft-run"])
    assert page.continue_button.isEnabled()  # readable: the config's values are checked when used
    qtbot.mouseClick(page.continue_button, Qt.MouseButton.LeftButton)
    from studio.main_window import TRAIN

    tp = window.training_panel
    assert window.pages.currentIndex() == TRAIN
    assert tp.banner.level == "error" and tp.banner.text().startswith("Cannot continue sft-run:"), tp.banner.text()
    assert "training.lr" in tp.banner.text()
    assert (dict(window.state.data["training"]), dict(window.state.data["lora"])) == before  # nothing half-set
