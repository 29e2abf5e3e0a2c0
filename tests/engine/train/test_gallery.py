"""The prompt gallery and the probe, engine side, on the demo: the held-out prompts (or typed
ones) are answered greedily at each checkpoint into GalleryAnswers and gallery.jsonl without
changing a single training loss; `probe` answers only while the run is paused, and a probe in
the pause leaves the resumed run's losses exactly those of a run without it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_eval import config, losses, run

from engine.api import ProbeUnavailable, RunFolder
from engine.train.session import TrainingSession


def test_the_gallery_answers_at_each_checkpoint_and_changes_nothing(tmp_path):
    run(config(steps=4, eval_every=0), tmp_path / "plain")
    session, events = run(config(steps=4, eval_every=0, save_every=2, gallery_size=2), tmp_path / "gallery")
    answers = [e for e in events if e.kind == "GalleryAnswers"]
    assert [a.step for a in answers] == [2, 4]
    assert all(len(a.prompts) == 2 and len(a.answers) == 2 for a in answers)
    assert answers[0].prompts == answers[1].prompts and all(p for p in answers[0].prompts)
    assert answers[1].checkpoint.endswith("step-4")
    records = RunFolder(tmp_path / "gallery").gallery()
    assert [(r["step"], r["prompt"]) for r in records] == [(s, p) for s in (2, 4) for p in answers[0].prompts]
    assert [r["answer"] for r in records[2:]] == answers[1].answers
    np.testing.assert_allclose(
        list(losses(tmp_path / "gallery").values()), list(losses(tmp_path / "plain").values()), rtol=1e-6
    )


def test_typed_gallery_prompts(tmp_path):
    prompts = ["The capital of France is", "12 plus 7 makes"]
    _, events = run(config(steps=2, eval_every=0, gallery_prompts=prompts), tmp_path / "typed")
    (answers,) = [e for e in events if e.kind == "GalleryAnswers"]
    assert answers.step == 2 and answers.prompts == prompts and len(answers.answers) == 2


def test_probe_only_while_paused_and_resume_stays_exact(tmp_path):
    _, straight = run(config(steps=5, eval_every=0), tmp_path / "straight")
    replies = []

    def probe_then_resume(session):
        replies.append(session.probe("The capital of France is", 8))
        replies.append(session.probe("The capital of France is", 8))
        session.request_resume()

    def on_event(session, e):
        if e.kind == "StepMetrics" and e.step == 2:
            with pytest.raises(ProbeUnavailable, match="not paused"):
                session.probe("hello", 4)
            session.request_pause()
        if e.kind == "Paused":  # the session thread is about to wait: probe from another thread
            threading.Thread(target=probe_then_resume, args=(session,)).start()

    run(config(steps=5, eval_every=0), tmp_path / "probed", on_event=on_event)
    assert replies[0][0] == 2 and replies[0] == replies[1]
    a, b = losses(tmp_path / "probed"), losses(tmp_path / "straight")
    np.testing.assert_allclose([a[s] for s in range(1, 6)], [b[s] for s in range(1, 6)], rtol=1e-5)


def test_probe_before_the_run_is_refused(tmp_path):
    session = TrainingSession(config(), None, run_dir=tmp_path / "never")
    with pytest.raises(ProbeUnavailable):
        session.probe("hello")


def test_the_gallery_prompts_go_in_one_packed_forward_per_token_and_answer_as_alone():
    """greedy_answers packs the prompts still answering into one batch per new token (the packed
    attention keeps each to itself): the answers are those of each prompt generated alone. (On
    the demo model the top two logits along these paths are >= 1.5e-3 apart, against fp32
    rounding of ~1e-5.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.resources import DEMO_MODEL_DIR
    from engine.train import evaluation

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    prompts = [evaluation.encode_prompt(tok, p, False) for p in ("The capital of France is", "12 plus 7 makes")]
    stops, cpu = evaluation.stop_token_ids(tok), torch.device("cpu")
    with evaluation.side_effect_free(model):
        together = evaluation.greedy_answers(model, prompts, 32, stops, cpu, 1024)
        alone = [evaluation.greedy_answers(model, [p], 32, stops, cpu, 1024)[0] for p in prompts]
    assert together == alone and all(len(a) == 32 for a in alone)
    assert tok.decode(alone[0]).startswith(" Paris")
