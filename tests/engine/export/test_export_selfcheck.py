"""Exports you can trust (issue 16), on the CPU: the demo model fine-tuned, then exported as an
adapter, a merged model and (when tunesmith[gguf] is installed) GGUF q8_0 and q4_k_m, each
loaded in its own runtime and compared with the trained model; broken exports reported failed
with the reason; the Ollama Modelfile's template and stop tokens against the tokenizer's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.export import EXPORTERS, ExportKind, SelfCheckFailed, export_and_check, modelfile, read_export_report
from engine.export import gguf as gguf_kind

STEPS = 60  # enough for the demo model to answer held-out prompts as "Answer: ..." and stop

GGUF_MISSING = gguf_kind.missing()
needs_gguf = pytest.mark.skipif(
    bool(GGUF_MISSING),
    reason=f"tunesmith[gguf] is not installed ({', '.join(GGUF_MISSING)} missing): `pip install -e .[gguf]` "
    "and `python -m engine.export fetch-converter`",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo preset, shortened: a run folder whose adapter answers in the trained format."""
    from engine.api import DEMO_PRESET, Finished, RunConfig, TrainingSession

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.training.max_steps = STEPS
    cfg.training.save_every = 0
    cfg.output.dir = str(tmp_path_factory.mktemp("runs"))
    cfg.output.run_name = "demo"
    result = TrainingSession(cfg, lambda e: None).run()
    assert isinstance(result, Finished), getattr(result, "message", result)
    return Path(cfg.output.dir) / "demo"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """Adapter and merged (and GGUF q8_0 reusing the merged folder, when available) in one flow."""
    out = tmp_path_factory.mktemp("exports")
    requests = {"adapter": out / "adapter", "merged": out / "merged"}
    if not GGUF_MISSING:
        requests["gguf"] = out / "demo-q8_0.gguf"
    lines: list[str] = []
    result = export_and_check(trained, requests, progress=lines.append, options={"gguf": {"quant": "q8_0"}})
    return result, out, lines


def _by_kind(verdicts):
    return {v.kind: v for v in verdicts}


@pytest.mark.slow
def test_adapter_and_merged_are_verified(trained, exported):
    result, out, lines = exported
    v = _by_kind(result.verdicts)
    assert v["adapter"].status == "verified", v["adapter"].summary
    assert v["adapter"].metrics["top1_agreement"] == 1.0 and v["adapter"].metrics["kl"] < 1e-6
    assert v["merged"].ok, v["merged"].summary  # bf16 rounding only
    assert v["merged"].metrics["kl"] < 0.01
    for kind in ("adapter", "merged"):
        lint = {x["name"]: x for x in v[kind].lints}
        assert lint["template"]["ok"] and lint["stops"]["ok"], v[kind].lints
        # The trained format, and each reply ends by itself.
        assert v[kind].replies and all(r["reply"].startswith("Answer:") and r["stopped"] for r in v[kind].replies)
    assert any(line.startswith("adapter: verified") for line in lines)
    # The run folder's export-report.json holds the verdicts.
    report = read_export_report(trained)
    assert report["adapter"]["status"] == "verified" and report["merged"]["status"] in (
        "verified",
        "verified with a drop",
    )
    assert report["merged"]["artefact"] == str(out / "merged")
    # The merged folder stops where the template ends a turn.
    gen = json.loads((out / "merged" / "generation_config.json").read_text())
    assert gen["eos_token_id"] in (2, [2])


@pytest.mark.slow
def test_a_merged_model_with_the_adapter_scale_wrong_is_reported_failed(trained, tmp_path, monkeypatch):
    """A merge that doubles the LoRA scale (the wrong alpha / r, a classic) writes a model that
    loads fine and looks complete; the self-check fails it and nothing is published."""
    good = EXPORTERS["merged"]

    def wrong_scale_write(source, out, progress=None, **_options):
        import torch
        from peft import PeftModel

        from engine.export.selfcheck import trained_tokenizer
        from engine.models.loading import load_model

        cfg = source.config().model
        model = PeftModel.from_pretrained(load_model(cfg, "cpu", "float32"), str(source.adapter))
        for module in model.modules():
            if hasattr(module, "scaling") and isinstance(module.scaling, dict):
                module.scaling = {k: 2 * s for k, s in module.scaling.items()}
        model.merge_and_unload().to(torch.bfloat16).save_pretrained(out)
        trained_tokenizer(source).save_pretrained(out)

    monkeypatch.setitem(EXPORTERS, "merged", ExportKind(**{**good.__dict__, "write": wrong_scale_write}))
    with pytest.raises(SelfCheckFailed) as err:
        export_and_check(trained, {"merged": tmp_path / "merged"})
    verdict = err.value.verdicts[-1]
    assert verdict.status == "failed" and verdict.kind == "merged"
    assert "failed its self-check" in str(err.value)
    assert any(word in verdict.reasons[0] for word in ("top-1 agreement", "KL divergence", "perplexity"))
    assert not (tmp_path / "merged").exists() and not (tmp_path / ".merged.partial").exists()
    assert read_export_report(trained)["merged"]["status"] == "failed"


# -- GGUF ----------------------------------------------------------------------------------------
@needs_gguf
@pytest.mark.slow
def test_gguf_q8_0_answers_in_the_trained_format_and_stops(exported):
    result, out, _ = exported
    v = _by_kind(result.verdicts)["gguf"]
    assert v.ok, v.summary
    lint = {x["name"]: x for x in v.lints}
    for name in ("eos", "turn end", "template", "tokenizer", "stops"):
        assert lint[name]["ok"], lint[name]
    assert v.replies and all(r["reply"].startswith("Answer:") and r["stopped"] for r in v.replies), v.replies
    assert (out / "demo-q8_0.gguf").is_file() and (out / "Modelfile").is_file()
    assert not (out / ".demo-q8_0.gguf.partial").exists()
    extras = result.extras["gguf"]
    assert extras["ollama_command"] == f'ollama create demo-q8_0 -f "{out / "Modelfile"}"'
    assert modelfile.read_modelfile(out / "Modelfile")["from"] == "./demo-q8_0.gguf"


@needs_gguf
@pytest.mark.slow
def test_gguf_q4_k_m_from_the_command_line_is_verified_with_its_drop_stated(trained, tmp_path):
    """The CLI path: the merged model is written first in 16 bits (a scratch copy), converted,
    quantized to q4_k_m, self-checked, and the verdict and the ollama command printed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "export",
            str(trained),
            "--gguf",
            str(tmp_path / "m.gguf"),
            "--quant",
            "q4_k_m",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "self-check gguf: verified" in out.stdout and "for Ollama: ollama create demo-q4_k_m" in out.stdout
    # Nothing after the verdict: llama-cpp-python's /dev/null files used to be reported unclosed at exit.
    assert "ResourceWarning" not in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "m.gguf"]
    v = read_export_report(trained)["gguf"]
    assert v["metrics"]["quant"] == "q4_k_m" and v["thresholds"]["max_ppl_drop"] == 0.30
    assert all(r["reply"].startswith("Answer:") and r["stopped"] for r in v["replies"]), v["replies"]


@needs_gguf
@pytest.mark.slow
def test_a_gguf_without_eos_is_reported_failed(trained, exported, tmp_path):
    """The q8_0 GGUF rewritten by the gguf package's own metadata tool without
    tokenizer.ggml.eos_token_id: llama.cpp still loads it, the self-check fails it."""
    from engine.export import ExportSource
    from engine.export.selfcheck import Reference

    _, out, _ = exported
    broken = tmp_path / "broken"
    broken.mkdir()
    tool = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force"]
    tool += ["--remove-metadata", "tokenizer.ggml.eos_token_id", str(out / "demo-q8_0.gguf"), str(broken / "x.gguf")]
    done = subprocess.run(tool, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    verdict = gguf_kind.verify(broken, ExportSource.resolve(trained), Reference(ExportSource.resolve(trained)))
    assert verdict.status == "failed"
    assert "no tokenizer.ggml.eos_token_id" in verdict.reasons[0]


# -- the Modelfile ---------------------------------------------------------------------------------
def _tokenizer(template: str | None = None, bos: str | None = None):
    from transformers import AutoTokenizer

    from engine.resources import DEMO_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    if template is not None:
        tok.chat_template = template
    if bos is not None:
        tok.bos_token = bos
    return tok


LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NUMBERED_TURNS = (  # a per-turn counter: no fixed text before and after each message
    "{% for message in messages %}{{ '<|im_start|>' + loop.index|string + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_the_modelfile_template_and_stops_match_the_tokenizer(tmp_path):
    tok = _tokenizer()
    info = modelfile.write_modelfile(tmp_path, "demo.gguf", tok, {"eos_token_id": 2, "temperature": 0.7})
    written = modelfile.read_modelfile(tmp_path / "Modelfile")
    assert info["template_translated"] and written["template"] is not None
    tr = modelfile.translate(tok)
    assert written["template"] == tr.template  # Go's own text/template renders it: tests/engine/export_conformance/
    for msgs in modelfile.checks():
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tr.render(msgs) == want
    assert written["stops"] == [tok.eos_token] == ["<|im_end|>"]
    assert written["parameters"] == {"temperature": "0"}  # greedy, as transformers decodes without do_sample
    assert written["from"] == "./demo.gguf"


def test_llama3_shape_translates_without_the_bos_the_runtime_adds():
    tok = _tokenizer(LLAMA3, bos="<|endoftext|>")
    tr = modelfile.translate(tok, runtime_adds_bos=True)
    assert tr.template is not None and tr.bos_dropped == "<|endoftext|>"
    msgs = modelfile.checks()[1]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<|endoftext|>") and "<|endoftext|>" + tr.render(msgs) == want
    assert tr.shape.rules["user"] == "trim" and "<|endoftext|>" not in tr.template


def test_a_template_that_cannot_be_translated_says_why(tmp_path):
    tok = _tokenizer(NUMBERED_TURNS)
    info = modelfile.write_modelfile(tmp_path, "demo.gguf", tok, {"eos_token_id": 2, "do_sample": True, "top_p": 0.9})
    text = (tmp_path / "Modelfile").read_text()
    assert not info["template_translated"] and "does not render each message on its own" in info["template_reason"]
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "") and "cannot be translated" in text
    assert 'PARAMETER stop "<|im_end|>"' in text and "PARAMETER top_p 0.9" in text


def test_gguf_tests_skip_only_when_the_extra_is_missing():
    installed = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None
    assert bool(GGUF_MISSING) == (not installed or not (gguf_kind.converter_dir() / "convert_hf_to_gguf.py").is_file())


# -- the Hub (optional) ----------------------------------------------------------------------------
@pytest.mark.slow
def test_hub_push_offline_is_one_sentence_and_the_card_comes_from_the_run(trained, exported, monkeypatch):
    from engine.export import ExportError, hub

    _, out, _ = exported
    card = hub.model_card(trained, "adapter")
    assert "Fine-tuned with Tunesmith (LoRA) from **demo**" in card and "verified" in card
    assert "final_loss" in card and "max_seq_len 512" in card and "```yaml" in card
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match=r"^the Hugging Face Hub is switched off here \(HF_HUB_OFFLINE is set\)"):
        hub.push(out / "adapter", "someone/demo", trained, "adapter")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    # A Hub that cannot be reached (nothing listens on this port): one sentence, nothing else breaks.
    with pytest.raises(ExportError) as err:
        hub.push(out / "adapter", "someone/demo", trained, "adapter", token="x", endpoint="http://127.0.0.1:9")
    assert str(err.value) == "cannot reach the Hugging Face Hub (127.0.0.1:9), so nothing was pushed"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
