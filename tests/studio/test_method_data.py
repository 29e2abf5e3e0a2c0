"""The Data page for the methods beyond SFT (issue 30): a preference pair side by side with the
trained tokens of each answer (the engine's own rendering of the pair, token for token), a KTO row
with its label, and GRPO's prompts files (detected, previewed with the columns the rewards read,
Train allowed for GRPO and refused for SFT with the reason). A real window on the demo model."""

from __future__ import annotations

import json

from engine.api import DataConfig, load_tokenizer
from engine.config import RunConfig
from engine.data.preference import prepare_preference_data
from engine.data.sources import load_raw


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _load(dp, qtbot, path):
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    with qtbot.waitSignal(dp.xray_ready, timeout=120_000):
        dp.load_source(str(path))


def _engine_example(window, path, kind, index):
    """What training packs for row `index`: (prompt, answer[, answer]) token ids."""
    cfg = RunConfig.from_dict({"data": dict(window.state.get("data"))}).data
    tok = load_tokenizer(RunConfig.from_dict({"model": dict(window.state.get("model"))}).model)
    raw = load_raw(DataConfig(source=str(path)))
    return prepare_preference_data(cfg, tok, kind, raw=raw.select([index])).examples[0]


def test_a_pair_shows_prompt_chosen_and_rejected_side_by_side(window, qtbot, tmp_path):
    dp = window.data_panel
    path = _write(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "What is 7 plus 5?", "chosen": "Answer: 12", "rejected": "Answer: 13"},
            {"prompt": "Name a primary colour.", "chosen": "Answer: red", "rejected": "Answer: purple, I think"},
        ],
    )
    _load(dp, qtbot, path)
    dp.show_example(1)
    qtbot.waitUntil(lambda: dp.example is not None and dp.example.index == 1, timeout=60_000)
    view = dp.pair_view
    assert dp.example_stack.currentWidget() is view
    assert view.rejected_box.isVisibleTo(view)
    prompt, chosen, rejected = (view.views[n] for n in ("prompt", "chosen", "rejected"))
    assert "primary colour" in prompt.text.toPlainText() and prompt.num_trained == 0
    assert "red" in chosen.text.toPlainText() and "purple" not in chosen.text.toPlainText()
    assert "purple" in rejected.text.toPlainText()
    # Exactly the tokens training packs for this pair, every answer token trained.
    p, c, r = _engine_example(window, path, "paired", 1)
    assert (prompt.num_tokens, chosen.num_tokens, rejected.num_tokens) == (len(p), len(c), len(r))
    assert chosen.num_trained == len(c) and rejected.num_trained == len(r)
    assert "Chosen" in view.label_text("chosen") and "Rejected" in view.label_text("rejected")


def test_a_kto_row_shows_its_answer_and_label(window, qtbot, tmp_path):
    dp = window.data_panel
    path = _write(
        tmp_path / "kto.jsonl",
        [
            {"prompt": "What is 7 plus 5?", "completion": "Answer: 12", "label": True},
            {"prompt": "What is 7 plus 5?", "completion": "Answer: 75", "label": False},
        ],
    )
    window.state.set("training.method", "kto")  # KTO reads prompt/completion/label (SFT would read instruction/output)
    _load(dp, qtbot, path)
    assert "KTO" in dp.summary.text() and not dp.problem
    dp.show_example(1)
    qtbot.waitUntil(lambda: dp.example is not None and dp.example.index == 1, timeout=60_000)
    view = dp.pair_view
    assert dp.example_stack.currentWidget() is view and not view.rejected_box.isVisibleTo(view)
    assert "undesirable" in view.label_text("chosen")
    assert "75" in view.views["chosen"].text.toPlainText()
    # Back to SFT on the demo: the plain one-piece example again.
    window.state.set("training.method", "sft")
    with qtbot.waitSignal(dp.example_ready, timeout=120_000):
        dp.load_source("demo")
    assert dp.example_stack.currentWidget() is dp.mask_view and dp.mask_view.num_trained > 0


def _pick(window, method):
    box = window.training_panel.method.box
    box.setCurrentIndex(box.findData(method))
    assert window.state.get("training.method") == method


def _ready(dp, qtbot, action, packed=True):
    """Run `action` (a load or a method change) and wait for the page's verdict (and packing)."""
    with qtbot.waitSignals([dp.preview_ready, dp.packing_ready] if packed else [dp.preview_ready], timeout=120_000):
        action()


def test_a_prompts_file_is_grpo_data_and_says_why_it_cannot_train_sft(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    path = _write(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "What is 7 plus 5?", "target": "12", "level": "easy"},
            {"prompt": "What is 12 times 12?", "target": "144", "level": "hard"},
        ],
    )
    _pick(window, "grpo")
    _ready(dp, qtbot, lambda: dp.load_source(str(path)))
    assert "prompts (GRPO)" in dp.summary.text() and not dp.problem
    note = dp.reward_columns
    assert note.isVisibleTo(dp) and "target" in note.text() and "level" in note.text()
    assert "exact-match" in note.text() and "**row" in note.text()
    qtbot.waitUntil(lambda: window.training_panel.train.isEnabled(), timeout=60_000)
    assert window.train_blocker() == ""
    assert dp.tabs.tabText(4) == "X-ray (n/a)"  # its findings are about answers; not a failure
    # The example: the prompt as generation starts from it (nothing trained), its reward columns.
    qtbot.waitUntil(lambda: dp.example is not None and dp.example.index == 0, timeout=60_000)
    assert dp.example_stack.currentWidget() is dp.mask_view
    assert dp.mask_view.num_trained == 0 and dp.mask_view.num_tokens > 0
    assert "target = 12" in dp.mask_view.counts.text() and "7 plus 5" in dp.mask_view.text.toPlainText()
    # The same file with SFT chosen: Train is off, and the reason says what the file is.
    _ready(dp, qtbot, lambda: _pick(window, "sft"), packed=False)  # columns SFT cannot map: nothing to pack
    assert "prompts without answers" in dp.problem and "GRPO" in dp.problem
    assert not note.isVisibleTo(dp)
    qtbot.waitUntil(lambda: not window.training_panel.train.isEnabled(), timeout=60_000)
    assert "prompts without answers" in window.train_blocker()
    assert "pick GRPO on the Train page" in dp.banner.text()
    # Back to GRPO: allowed again.
    _ready(dp, qtbot, lambda: _pick(window, "grpo"))
    qtbot.waitUntil(lambda: window.training_panel.train.isEnabled(), timeout=60_000)
    assert not dp.problem


def test_a_dpo_run_on_sft_data_says_what_dpo_reads(window, qtbot):
    """DPO chosen with the demo's instruction rows: the Data page says DPO needs pairs."""
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None and not dp.loading, timeout=60_000)
    assert not dp.problem
    with qtbot.waitSignal(dp.preview_ready, timeout=120_000):
        _pick(window, "dpo")
    assert "DPO reads prompt / chosen / rejected pairs" in dp.problem
    qtbot.waitUntil(lambda: not window.training_panel.train.isEnabled(), timeout=60_000)


def test_a_pairs_file_with_sft_chosen_says_which_methods_train_it(window, qtbot, tmp_path):
    """SFT chosen with prompt/chosen/rejected rows: Train is off before it is pressed, and the
    reason names the methods that read pairs (the run used to fail only once it started)."""
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None and not dp.loading, timeout=60_000)
    path = _write(
        tmp_path / "pairs.jsonl",
        [{"prompt": f"What is {i} plus 1?", "chosen": f"Answer: {i + 1}", "rejected": "Answer: 0"} for i in range(4)],
    )
    assert window.state.get("training.method") == "sft"
    _ready(dp, qtbot, lambda: dp.load_source(str(path)), packed=False)
    assert "preference pairs" in dp.problem and "DPO, ORPO or SimPO" in dp.problem
    qtbot.waitUntil(lambda: not window.training_panel.train.isEnabled(), timeout=60_000)
    assert "DPO, ORPO or SimPO" in window.train_blocker()
    _ready(dp, qtbot, lambda: _pick(window, "dpo"), packed=False)
    assert not dp.problem
    qtbot.waitUntil(lambda: window.training_panel.train.isEnabled(), timeout=60_000)
