"""Preference, KTO and GRPO data (engine.data.preference) and the reward functions
(engine.train.rewards): the formats detected, what the tokens are, and bad input named."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.config import DataConfig, RewardConfig
from engine.data.preference import detect_preference_format, prepare_preference_data
from engine.data.sources import DataError
from engine.resources import DEMO_MODEL_DIR
from engine.train.rewards import RewardError, build_rewards, score


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def _file(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(source=str(path), max_seq_len=128)


def _render(tok, messages, gen=False):
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen), add_special_tokens=False)[
        "input_ids"
    ]


def test_text_and_conversational_pairs_give_the_same_tokens(tmp_path, tok):
    text = _file(
        tmp_path, [{"prompt": "What is 7 plus 5?", "chosen": "Answer: 12", "rejected": "Answer: 13"}], "t.jsonl"
    )
    conv = _file(
        tmp_path,
        [
            {
                "prompt": [{"role": "user", "content": "What is 7 plus 5?"}],
                "chosen": [{"role": "assistant", "content": "Answer: 12"}],
                "rejected": [{"role": "assistant", "content": "Answer: 13"}],
            }
        ],
        "c.jsonl",
    )
    implicit = _file(
        tmp_path,
        [
            {
                "chosen": [
                    {"role": "user", "content": "What is 7 plus 5?"},
                    {"role": "assistant", "content": "Answer: 12"},
                ],
                "rejected": [
                    {"role": "user", "content": "What is 7 plus 5?"},
                    {"role": "assistant", "content": "Answer: 13"},
                ],
            }
        ],
        "i.jsonl",
    )
    got = [prepare_preference_data(cfg, tok, "paired").examples[0] for cfg in (text, conv, implicit)]
    assert got[0] == got[1] == got[2]
    prompt, chosen, rejected = got[0]
    msgs = [{"role": "user", "content": "What is 7 plus 5?"}]
    assert prompt == _render(tok, msgs, gen=True)
    assert prompt + chosen == _render(tok, msgs + [{"role": "assistant", "content": "Answer: 12"}])
    assert tok.eos_token_id in chosen and tok.eos_token_id in rejected  # the answer learns to stop
    data = prepare_preference_data(text, tok, "paired")
    assert data.docs[0] == prompt + chosen + prompt + rejected and data.packing.rows == [[0]]


def test_bad_pairs_are_skipped_with_their_row_and_reason(tmp_path, tok):
    rows = [
        {"prompt": "Q1", "chosen": "same", "rejected": "same"},
        {"prompt": "Q2", "chosen": "", "rejected": "no"},
        {"prompt": "Q3", "chosen": "yes", "rejected": 5},
        {"prompt": "Q4", "chosen": "Answer: A " * 80, "rejected": "Answer: B " * 80},
        {"prompt": "Q5", "chosen": "good", "rejected": "bad"},
        {
            "prompt": "Q6",
            "chosen": [
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
            ],
            "rejected": "no",
        },
    ]
    data = prepare_preference_data(_file(tmp_path, rows), tok, "paired")
    reasons = dict(data.skipped)
    assert "the same answer" in reasons[0]
    assert "empty" in reasons[1]
    assert "neither text nor" in reasons[2]
    assert "message 0 calls a tool, which preference pairs do not take" in reasons[5]  # not dropped from the pair
    assert len(data.examples) == 2 and data.truncated == 1  # row 3 cut to fit a row with its twin
    assert data.row_ids == [3, 4] and len(data.docs[0]) <= 128  # both sides of row 3 share one row


def test_missing_columns_name_the_file_and_the_mapping(tmp_path, tok):
    cfg = _file(tmp_path, [{"question": "Q", "good": "a", "bad": "b"}])
    with pytest.raises(DataError, match=r"data\.jsonl: the columns question, good, bad have no chosen / rejected"):
        prepare_preference_data(cfg, tok, "paired")
    cfg.columns = {"chosen": "good", "rejected": "bad", "prompt": "question"}
    assert len(prepare_preference_data(cfg, tok, "paired").examples) == 1
    with pytest.raises(DataError, match=r"data.columns.chosen: column 'nope'"):
        detect_preference_format(["a"], "paired", {"chosen": "nope"})


def test_kto_rows_get_their_label_and_the_previous_completion_as_kl_twin(tmp_path, tok):
    rows = [
        {"prompt": "Q1", "completion": "A1", "label": True},
        {"prompt": "Q2", "completion": "A2", "label": False},
        {"prompt": "Q3", "completion": "A3", "label": "maybe"},
    ]
    data = prepare_preference_data(_file(tmp_path, rows), tok, "unpaired")
    assert data.labels == [True, False] and "not true/false" in dict(data.skipped)[2]
    (p1, c1, kl1), (p2, c2, kl2) = data.examples
    assert kl1 == c2 and kl2 == c1  # cycled by one, as TRL's KTOTrainer does


def test_grpo_prompts_keep_their_other_columns(tmp_path, tok):
    data = prepare_preference_data(
        _file(tmp_path, [{"prompt": "Q", "answer": "42", "topic": "math"}]), tok, "prompts", 16
    )
    assert data.rows == [{"prompt": "Q", "answer": "42", "topic": "math"}]
    assert data.packing.row_tokens == len(data.docs[0]) + 16


def test_built_in_rewards():
    rewards = build_rewards(
        [
            RewardConfig(kind="regex", pattern=r"Answer: [^\n]+"),
            RewardConfig(kind="exact", column="answer", pattern=r"Answer: (.+)"),
            RewardConfig(kind="length", max_chars=10),
        ]
    )
    assert [r.name for r in rewards] == ["format", "exact_answer", "length"]
    table = score(rewards, ["q"] * 3, ["Answer: 42", "Answer: 41\nmore", "42"], [{"answer": "42"}] * 3, [0, 1, 2])
    assert table[0] == [1.0, 1.0, 0.0]
    assert table[1][:2] == [0.0, 0.0] and table[1][2] == pytest.approx(-0.5)
    assert table[2][:2] == [0.0, 0.0]


def test_a_user_reward_file_is_called_and_its_errors_named(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def reward(prompt, completion, **row):\n    return len(completion) / row['n']\n")
    (r,) = build_rewards([RewardConfig(kind="python", file=str(f))])
    assert r.name == "mine" and score([r], ["p"], ["abcd"], [{"n": 2}], [7]) == [[2.0]]
    with pytest.raises(RewardError, match=r"reward 'mine' failed on row 8: ZeroDivisionError"):
        score([r], ["p"], ["abcd"], [{"n": 0}], [7])
    f.write_text("def reward(prompt, completion, **row):\n    return float('nan')\n")
    (r,) = build_rewards([RewardConfig(kind="python", file=str(f))])
    with pytest.raises(RewardError, match="returned nan on row 4"):
        score([r], ["p"], ["x"], [{}], [3])
    f.write_text("def scorer(): pass\n")
    with pytest.raises(RewardError, match=r"mine.py: defines no function `reward"):
        build_rewards([RewardConfig(kind="python", file=str(f))])
    f.write_text("syntax error here(\n")
    with pytest.raises(RewardError, match=r"mine.py: loading the reward file failed: SyntaxError"):
        build_rewards([RewardConfig(kind="python", file=str(f))])
    with pytest.raises(RewardError, match=r"no such reward file"):
        build_rewards([RewardConfig(kind="python", file=str(tmp_path / "gone.py"))])


def test_the_data_preview_reads_pair_files(tmp_path, tok):
    """The Data page's preview, example and packing (engine.data.preview) on a pairs file: the
    format is named, no 'no known shape' error, the packing is the run's (two sides a row). (A KTO
    file's prompt / completion columns already read as SFT's instruction format there.)"""
    from engine.data.preview import load_preview, packing_layout, render_example

    pairs = _file(
        tmp_path,
        [{"prompt": f"What is {i} plus 1?", "chosen": f"Answer: {i + 1}", "rejected": "Answer: 0"} for i in range(6)],
        "pairs.jsonl",
    )
    preview = load_preview(pairs)
    assert preview.error is None and preview.format.kind == "preference pairs"
    assert preview.mapping == {"chosen": "chosen", "rejected": "rejected", "prompt": "prompt"}
    layout = packing_layout(tok, pairs)
    data = prepare_preference_data(pairs, tok, "paired")
    assert layout.examples == 6 and layout.rows == [[len(data.docs[d]) for d in row] for row in data.packing.rows]
    ex = render_example(tok, pairs, 2)
    assert ex.n_tokens == len(data.docs[2]) and "".join(t for t, on in ex.pieces if on).count("Answer") == 2

    # A lone prompt-like column is not taken for GRPO prompts: the SFT mapping is still offered.
    lone = _file(tmp_path, [{"question": "What is 1 plus 1?", "notes": "x"}], "lone.jsonl")
    assert load_preview(lone).error is not None
