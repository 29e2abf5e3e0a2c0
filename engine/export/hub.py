"""Push an exported adapter or merged model to the Hugging Face Hub, with a model card generated
from the run: the base model, the data, the config, the final losses and the export's self-check
verdict. Offline (HF_HUB_OFFLINE, or the Hub cannot be reached) it fails with one sentence and
touches nothing else: the export itself is already on disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from engine import runs
from engine.export import ExportError, read_export_report

HUB_HOST = "huggingface.co"


def _final_losses(run: runs.RunFolder) -> dict:
    """The last training loss and the run's summary (final_loss, steps...), from the run's history
    as engine.runs reads it back (the Runs page's reader: one reading of metrics.jsonl)."""
    out: dict = {}
    hist = run.history()
    if hist.steps:
        out["last_step"], out["last_loss"] = hist.steps[-1], hist.curves["loss"][-1]
    outcome = hist.outcome or {}
    if outcome.get("event") == "Finished":
        out.update({k: v for k, v in (outcome.get("summary") or {}).items() if "loss" in k or k == "steps"})
    return out


def model_card(src: str | Path, kind: str) -> str:
    """README.md for the pushed folder, from the run that `src` belongs to."""
    import yaml

    run = runs.RunFolder.of(src)
    config, _ = run.read_config()  # {} when it cannot be read: the card says "unknown"
    model = (config.get("model") or {}).get("name_or_path", "unknown")
    data = config.get("data") or {}
    losses = _final_losses(run)
    verdict = read_export_report(src).get(kind, {})
    lines = [
        "---",
        "library_name: peft" if kind == "adapter" else "library_name: transformers",
        f"base_model: {model}" if model not in ("demo", "unknown") else "tags: [tunesmith]",
        "---",
        "",
        f"# {run.path.name} ({kind})",
        "",
        f"Fine-tuned with Tunesmith (LoRA) from **{model}**.",
        "",
        "## Data",
        f"- source: `{data.get('source', '?')}`, format `{data.get('format', '?')}`, "
        f"max_seq_len {data.get('max_seq_len', '?')}, responses only: {data.get('train_on_responses_only', '?')}",
        "",
        "## Training",
    ]
    lines += [f"- {k}: {v}" for k, v in losses.items()] or ["- (no metrics)"]
    lines += ["", "## Export self-check"]
    if verdict:
        lines.append(f"- {verdict.get('summary', verdict.get('status'))}")
        m = verdict.get("metrics") or {}
        for key in ("top1_agreement", "kl", "ppl_reference", "ppl_artefact", "examples_from"):
            if key in m:
                lines.append(f"- {key}: {m[key]}")
    else:
        lines.append("- not checked")
    lines += ["", "## Config", "```yaml", yaml.safe_dump(config, sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def push(
    folder: str | Path,
    repo_id: str,
    src: str | Path,
    kind: str,
    private: bool = True,
    token: Optional[str] = None,
    progress=None,
    endpoint: Optional[str] = None,
) -> str:
    """Upload `folder` (an export of `kind` of the run `src`) to `repo_id` with a generated model
    card; returns the repo's URL. ExportError (one sentence) when offline or refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not an exported folder; export the {kind} first")
    verdict = read_export_report(src).get(kind)
    if verdict and verdict.get("status") == "failed":
        raise ExportError(f"the {kind} failed its self-check ({verdict.get('summary')}); it is not pushed")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ExportError("the Hugging Face Hub is switched off here (HF_HUB_OFFLINE is set), so nothing was pushed")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    (folder / "README.md").write_text(model_card(src, kind), encoding="utf-8")
    api = HfApi(token=token, endpoint=endpoint)
    host = (endpoint or f"https://{HUB_HOST}").split("//", 1)[-1].split("/", 1)[0]
    try:
        if progress:
            progress(f"creating {repo_id} on the Hub")
        api.create_repo(repo_id, private=private, exist_ok=True)
        if progress:
            progress(f"uploading {folder} to {repo_id}")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=f"Tunesmith export ({kind})")
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise ExportError(f"the Hub refused the push to {repo_id} (HTTP {status}); nothing was pushed") from None
    except Exception as exc:  # the HTTP client's own types (not OSErrors in every version)
        name = type(exc).__name__
        if isinstance(exc, OSError) or any(w in name for w in ("Connect", "Timeout", "Network", "Transport")):
            raise ExportError(f"cannot reach the Hugging Face Hub ({host}), so nothing was pushed") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        raise ExportError(f"the push to {repo_id} failed ({first}); nothing was pushed") from None
    return f"{(endpoint or 'https://' + HUB_HOST).rstrip('/')}/{repo_id}"
