"""One row, one error, on real templates: a row the chat template rejects (Gemma-2's "System role
not supported", Mistral v0.2's alternating roles) is dropped with its number and reason, in
training (prepare_dataset, then `tunesmith train`) and in the X-ray; when every row fails the run
does not start and says why; data.fold_system_message folds the system message instead. Also the
earlier-reasoning choice on Qwen3 and the preview's pieces on sentencepiece and byte-level
vocabularies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from engine.config import DataConfig
from engine.data.dataset import prepare_dataset
from engine.data.preview import render_example
from engine.data.sources import DataError
from engine.data.xray import xray
from tests.conformance.conversations import CONVERSATIONS


def write_rows(path, names):
    path.write_text("".join(json.dumps({"messages": CONVERSATIONS[n]}) + "\n" for n in names))
    return str(path)


MIXED = ["single", "system_single", "multi_turn", "system_multi_turn"]  # rows 1 and 3 have a system prompt


def test_gemma2_drops_system_rows_with_their_number_and_reason(tmp_path, family_tokenizer):
    tok = family_tokenizer("gemma-2")
    cfg = DataConfig(source=write_rows(tmp_path / "mixed.jsonl", MIXED))
    data = prepare_dataset(cfg, tok)
    assert len(data.docs) == 2
    assert [i for i, _ in data.skipped] == [1, 3]
    for _, reason in data.skipped:
        assert "System role not supported" in reason and "data.fold_system_message: true" in reason
    found = {(f.kind, f.row) for f in xray(cfg, tok).findings}
    assert {("rejected", 1), ("rejected", 3)} <= found


def test_gemma2_folds_the_system_message_when_asked(tmp_path, family_tokenizer):
    tok = family_tokenizer("gemma-2")
    cfg = DataConfig(source=write_rows(tmp_path / "mixed.jsonl", MIXED), fold_system_message=True)
    data = prepare_dataset(cfg, tok)
    assert len(data.docs) == 4 and data.skipped == []
    # The system text is in the (masked) first user turn, never trained.
    doc, trained = data.docs[1], data.trained[1]
    assert "terse geography tutor" in tok.decode(doc)
    assert "geography" not in tok.decode([t for t, m in zip(doc, trained) if m])
    example = render_example(tok, cfg, 1)
    assert "".join(p for p, t in example.pieces if t) == "Lima.<end_of_turn>"


def test_every_row_rejected_stops_before_the_run_with_a_sentence(tmp_path, family_tokenizer):
    tok = family_tokenizer("gemma-2")
    cfg = DataConfig(source=write_rows(tmp_path / "sys.jsonl", ["system_single", "system_multi_turn"]))
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, tok)
    text = str(err.value)
    assert "the run cannot start" in text and "every row failed" in text
    assert "System role not supported" in text and "fold_system_message" in text


def test_roles_not_alternating_is_one_rows_error(tmp_path, family_tokenizer):
    tok = family_tokenizer("mistral-v0.2")
    path = tmp_path / "roles.jsonl"
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    path.write_text(json.dumps({"messages": CONVERSATIONS["single"]}) + "\n" + json.dumps({"messages": bad}) + "\n")
    data = prepare_dataset(DataConfig(source=str(path)), tok)
    assert len(data.docs) == 1 and data.skipped[0][0] == 1 and "alternate" in data.skipped[0][1]
    with pytest.raises(DataError, match="row 2: the chat template rejects this row"):
        render_example(tok, DataConfig(source=str(path)), 1)


def train_cli(tmp_path, folder, rows, **data):
    """`tunesmith train` (python -m engine train) for 2 CPU steps; its stdout + stderr."""
    cfg = {
        "model": {"name_or_path": str(folder), "dtype": "float32", "load_in_4bit": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"source": rows, "max_seq_len": 128, "eval_fraction": 0, **data},
        "training": {"max_steps": 2, "rows_per_micro_batch": 2, "lr": 0.001, "device": "cpu"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(path), "--output", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 2/2" in out.stdout and "finished" in out.stdout
    return out.stdout + out.stderr


@pytest.mark.slow
def test_gemma2_with_system_rows_trains_from_the_command_line(tmp_path, family_folder):
    log = train_cli(tmp_path, family_folder("gemma-2"), write_rows(tmp_path / "mixed.jsonl", MIXED * 3))
    assert "Row 2 skipped: the chat template rejects this row: System role not supported" in log


@pytest.mark.slow
def test_qwen3_run_says_once_that_earlier_reasoning_is_dropped(tmp_path, family_folder):
    rows = write_rows(tmp_path / "reasoning.jsonl", ["reasoning_multi_turn", "reasoning_then_plain", "single"] * 2)
    log = train_cli(tmp_path, family_folder("qwen3"), rows, earlier_reasoning="keep")
    assert log.count("drops the <think> reasoning of earlier answers in 4 rows") == 1
    assert "each answer is trained as the last turn of its own example" in log


def _rows_of(tmp_path, name):
    return write_rows(tmp_path / f"{name}.jsonl", [name])


def test_qwen3_earlier_reasoning_choices(tmp_path, family_tokenizer):
    tok = family_tokenizer("qwen3")
    source = _rows_of(tmp_path, "reasoning_multi_turn")

    def trained_texts(choice):
        data = prepare_dataset(DataConfig(source=source, earlier_reasoning=choice), tok)
        return data, [tok.decode([t for t, m in zip(d, tr) if m]) for d, tr in zip(data.docs, data.trained)]

    data, texts = trained_texts("drop")
    assert texts == [
        "No: 91 = 7 × 13.<|im_end|><think>\nNo prime up to 9 divides 97.\n</think>\n\nYes, 97 is prime.<|im_end|>"
    ]
    assert "drops the <think> reasoning of earlier answers in 1 row" in data.notes[0]
    _, texts = trained_texts("final_turn_only")
    assert texts == ["<think>\nNo prime up to 9 divides 97.\n</think>\n\nYes, 97 is prime.<|im_end|>"]
    _, texts = trained_texts("keep")
    assert texts == [
        "<think>\n91 = 7 × 13.\n</think>\n\nNo: 91 = 7 × 13.<|im_end|>",
        "<think>\nNo prime up to 9 divides 97.\n</think>\n\nYes, 97 is prime.<|im_end|>",
    ]
    assert any(f.kind == "reasoning_dropped" for f in xray(DataConfig(source=source), tok).findings)


def test_qwen3_no_thinking_answer_trains_without_the_empty_think_block(tmp_path, family_tokenizer):
    tok = family_tokenizer("qwen3")
    example = render_example(tok, DataConfig(source=_rows_of(tmp_path, "single")), 0)
    shown = "".join(p for p, _ in example.pieces)
    assert "<think>\n\n</think>\n\nAir scatters" in shown  # the template writes the empty block ...
    assert "".join(p for p, t in example.pieces if t) == "Air scatters blue light more than red light.<|im_end|>"


@pytest.mark.parametrize("name", ["phi-3.5", "mistral-v1", "llama-3.2", "gemma-4"])
def test_preview_pieces_keep_blanks_and_newlines(tmp_path, name, family_tokenizer):
    tok = family_tokenizer(name)
    cfg = DataConfig(source=_rows_of(tmp_path, "multi_turn"))
    example = render_example(tok, cfg, 0)
    shown = "".join(p for p, _ in example.pieces)
    assert shown == tok.apply_chat_template(CONVERSATIONS["multi_turn"], tokenize=False)
    assert "Name a volcano in Italy." in shown and "Is it active?" in shown


# -- the preference methods read rows through the same render --------------------------------------
def _pairs(path, system: bool):
    head = [{"role": "system", "content": "Answer with the number only."}] if system else []
    rows = [
        {
            "prompt": head + [{"role": "user", "content": f"What is {i} plus 1?"}],
            "chosen": [{"role": "assistant", "content": str(i + 1)}],
            "rejected": [{"role": "assistant", "content": "I do not know."}],
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("family", ["gemma-2", "mistral-v0.2"])
def test_a_pair_the_template_rejects_is_a_rows_error_and_folding_trains_it(tmp_path, family_tokenizer, family):
    """DPO's pairs on templates without a system turn (Gemma-2 says so, Mistral v0.2 says the roles
    do not alternate): each row is dropped with its number, the template's reason and the option
    that helps, never a crash of the run ('Training failed: TemplateError'); with
    data.fold_system_message the system prompt goes into the first user turn and the pairs train,
    each answer's tokens after the prompt's exactly as SFT renders them."""
    from engine.data.preference import prepare_preference_data

    tok = family_tokenizer(family)
    source = _pairs(tmp_path / "pairs.jsonl", system=True)
    with pytest.raises(DataError) as err:
        prepare_preference_data(DataConfig(source=source, max_seq_len=256), tok, "paired")
    text = str(err.value)
    assert "row 1: the chat template rejects this row" in text and "data.fold_system_message: true" in text
    data = prepare_preference_data(DataConfig(source=source, max_seq_len=256, fold_system_message=True), tok, "paired")
    assert len(data.examples) == 3 and not data.skipped
    prompt, chosen, _ = data.examples[0]
    folded = [{"role": "user", "content": "Answer with the number only.\n\nWhat is 0 plus 1?"}]
    whole = tok.apply_chat_template(folded + [{"role": "assistant", "content": "1"}], tokenize=False)
    assert tok(whole, add_special_tokens=False)["input_ids"] == prompt + chosen


def test_the_export_self_check_renders_rows_as_training_did(family_tokenizer):
    """A Gemma-2 run trained with data.fold_system_message: the export's self-check renders its
    held-out rows the same way (it raised 'System role not supported' and the export failed), and
    a row the template rejects is left out, as training left it out."""
    from engine.export.selfcheck import make_probes

    tok = family_tokenizer("gemma-2")
    rows = [CONVERSATIONS[n] for n in MIXED]
    assert len(make_probes(tok, rows, DataConfig(source="x.jsonl"))) == 2  # the system rows are left out
    probes = make_probes(tok, rows, DataConfig(source="x.jsonl", fold_system_message=True))
    assert len(probes) == 4
    folded = next(p for p in probes if p.messages[0]["role"] == "system")
    assert tok(folded.text, add_special_tokens=False)["input_ids"] == folded.ids
    assert "<start_of_turn>model" in tok.decode(folded.prompt_ids[-3:])
