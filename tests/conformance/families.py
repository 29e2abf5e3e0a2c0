"""Tiny model folders of real model families, built from llama.cpp's upstream files (see
upstream.py): for each family its architecture class from transformers (2 layers, hidden 64, random
weights), its vocabulary rebuilt from a `ggml-vocab-*.gguf` and checked against llama.cpp's
reference tokenizations (vocab.py), its special tokens, and its official chat template: the
`models/templates/<HF repo>.jinja` file, or the template of a named case in
`tests/test-chat-template.cpp` where the templates folder has none.

    from tests.conformance.families import FAMILIES, build_family_folder, conversations_for
    folder = build_family_folder("qwen3")        # cached; AutoTokenizer / AutoModelForCausalLM load it
    for name, messages in conversations_for("qwen3").items(): ...

What is exact and what is the closest stand-in (each family's `notes` says it too):
- vocabulary exact: Qwen2.5 / Qwen3 / DeepSeek-R1-Distill-Qwen (qwen2), Llama-3.1 / 3.2, SmolLM3 and
  DeepSeek-R1-Distill-Llama (llama-bpe), Phi-3.5 (phi-3), Mistral v0.2 / v1 (llama-spm: the
  Llama-2 sentencepiece vocabulary Mistral 7B v0.1-v0.2 share in shape and size), Gemma-4 (gemma-4);
- closest vocabulary of the same tokenizer type, the family's own not being in the sdist: Mistral v3
  (llama-spm, with [INST] / [/INST] added as control tokens), Mistral Tekken, Phi-4 and GPT-OSS
  (llama-bpe: tiktoken-style byte-level BPE like theirs), Gemma-2 (gemma-4's sentencepiece vocabulary,
  with <start_of_turn> / <end_of_turn> added), Granite 3.3 and the SmolLM2-shaped ChatML family
  (starcoder: the 49,152-token byte-level shape both use);
- special tokens a family has and its stand-in vocabulary lacks are added under their real names
  (their ids differ from the real model's, which no test here depends on);
- templates from tests/test-chat-template.cpp: Mistral v0.2 and v1 (the upstream ones), Mistral v3
  (llama.cpp's copy is "modified to have the system prompt at start"), Phi-4.
Not covered (no upstream template in the llama-cpp-python 0.3.36 sdist): Gemma-3 (Gemma-4 stands in
for the newer Gemma template), SmolLM2's own template (ChatML stands in), Tekken's own vocabulary,
Phi-4's and GPT-OSS's o200k / cl100k vocabularies.

The folder cache lives beside the upstream files (upstream.cache_root()), keyed on the family,
the llama-cpp-python version and this file's FOLDER_VERSION; delete it to rebuild.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.conformance import upstream
from tests.conformance.conversations import CONVERSATIONS, REASONING, WITH_SYSTEM

FOLDER_VERSION = 3  # bump when what a folder holds changes


@dataclass(frozen=True)
class Family:
    name: str
    vocab: str  # ggml-vocab-<vocab>.gguf
    template: str  # "<file>" in models/templates (no .jinja), or "cpp:<test case name>"
    model_type: str  # transformers' model_type: its config and causal-LM class
    end_marker: str  # the end-of-turn token right after each answer (the last one, where they differ)
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    specials: tuple[str, ...] = ()  # added as special tokens when the vocabulary lacks them
    system: bool = True  # the template accepts a system message
    reasoning: bool = False  # the template parses <think> blocks in the assistant's content
    notes: str = ""
    history_end_marker: str | None = None  # the end token of earlier answers, when not end_marker
    # The template writes no end-of-turn token after the last answer; training puts end_marker there
    # (engine.data.render._close_last_answers: what the template writes when another turn follows).
    last_end_added: bool = False

    def end_of(self, last: bool) -> str:
        """The end-of-turn token after an answer: the last answer's, or an earlier one's."""
        return self.end_marker if last or self.history_end_marker is None else self.history_end_marker


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
_HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")
_GRANITE = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")
_THINK = ("<think>", "</think>")
_CHATML = ("<|im_start|>", "<|im_end|>")
_GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>") + _THINK
_COHERE = (
    "<BOS_TOKEN>",
    "<PAD>",
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_TEXT|>",
    "<|END_TEXT|>",
)
_KIMI = ("[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
_MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
_HY = ":opensource｜>"
_HUNYUAN = tuple(
    f"<｜{t}{_HY}" for t in ("hy_begin_of_sentence", "hy_User", "hy_Assistant", "hy_eos", "hy_pad", "reasoning_mode")
) + ("<think:opensource>", "</think:opensource>")
_STAND_IN = "vocabulary not in the sdist: {} (the same tokenizer type), the family's markers added"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "qwen3",
            "qwen2",
            "Qwen-Qwen3-0.6B",
            "qwen3",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            _QWEN + ("<think>", "</think>"),
            reasoning=True,
        ),
        Family(
            "qwen2.5",
            "qwen2",
            "Qwen-Qwen2.5-7B-Instruct",
            "qwen2",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            _QWEN,
        ),
        Family(
            "llama-3.1",
            "llama-bpe",
            "meta-llama-Llama-3.1-8B-Instruct",
            "llama",
            "<|eot_id|>",
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|end_of_text|>",
        ),
        Family(
            "llama-3.2",
            "llama-bpe",
            "meta-llama-Llama-3.2-3B-Instruct",
            "llama",
            "<|eot_id|>",
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|end_of_text|>",
        ),
        Family(
            "phi-3.5",
            "phi-3",
            "microsoft-Phi-3.5-mini-instruct",
            "phi3",
            "<|end|>",
            "<s>",
            "<|endoftext|>",
            "<|endoftext|>",
        ),
        Family(
            "phi-4",
            "llama-bpe",
            "cpp:phi-4",
            "phi3",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|end_of_text|>",
            ("<|im_start|>", "<|im_sep|>", "<|im_end|>"),
            notes="cl100k vocabulary not in the sdist: llama-bpe",
        ),
        Family(
            "mistral-v0.2",
            "llama-spm",
            "cpp:mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1 without a system prompt)",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            system=False,
        ),
        Family(
            "mistral-v1",
            "llama-spm",
            "cpp:mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
        ),
        Family(
            "mistral-v3",
            "llama-spm",
            "cpp:Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at start)",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            ("[INST]", "[/INST]"),
            notes="v3's 32,768 vocabulary not in the sdist: llama-spm with [INST]/[/INST] as control tokens",
        ),
        Family(
            "mistral-tekken",
            "llama-bpe",
            "mistralai-Mistral-Nemo-Instruct-2407",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            ("<s>", "</s>", "[INST]", "[/INST]"),
            notes="Tekken's vocabulary not in the sdist: llama-bpe (tiktoken-style byte-level BPE)",
        ),
        Family(
            "gemma-2",
            "gemma-4",
            "google-gemma-2-2b-it",
            "gemma2",
            "<end_of_turn>",
            "<bos>",
            "<eos>",
            "<pad>",
            ("<start_of_turn>", "<end_of_turn>"),
            system=False,
            notes="Gemma-2's 256k vocabulary not in the sdist: gemma-4's sentencepiece vocabulary",
        ),
        Family(
            "gemma-4",
            "gemma-4",
            "google-gemma-4-31B-it",
            "gemma4_text",
            "<turn|>",
            "<bos>",
            "<turn|>",
            "<pad>",
            notes="stands in for Gemma-3, whose template is not in the sdist",
        ),
        Family(
            "smollm3",
            "llama-bpe",
            "HuggingFaceTB-SmolLM3-3B",
            "smollm3",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|end_of_text|>",
            ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        ),
        Family(
            "smollm2-chatml",
            "starcoder",
            "cpp:teknium/OpenHermes-2.5-Mistral-7B",
            "llama",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            ("<|im_start|>", "<|im_end|>"),
            notes="SmolLM2's shape (Llama architecture, starcoder-type vocabulary, ChatML); its own "
            "template is not in the sdist: OpenHermes' ChatML from test-chat-template.cpp",
        ),
        Family(
            "deepseek-r1-qwen",
            "qwen2",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "qwen2",
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            _DEEPSEEK,
            reasoning=True,
        ),
        Family(
            "deepseek-r1-llama",
            "llama-bpe",
            "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
            "llama",
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            _DEEPSEEK,
            reasoning=True,
        ),
        Family(
            "gpt-oss",
            "llama-bpe",
            "openai-gpt-oss-120b",
            "gpt_oss",
            "<|return|>",
            None,
            "<|return|>",
            "<|end_of_text|>",
            _HARMONY,
            notes="o200k vocabulary not in the sdist: llama-bpe; reasoning lives in a 'thinking' field "
            "the data formats do not carry, so only final-channel answers are checked",
            history_end_marker="<|end|>",
        ),
        Family(
            "granite-3.3",
            "starcoder",
            "ibm-granite-granite-3.3-2B-Instruct",
            "granite",
            "<|end_of_text|>",
            "<|end_of_text|>",
            "<|end_of_text|>",
            "<|end_of_text|>",
            _GRANITE,
            notes="Granite's vocabulary not in the sdist: starcoder (the same 49,152-token shape)",
        ),
        # -- families beyond issues 19/26: each one template of models/templates checked as it is --
        Family(
            "granite-4.0",
            "starcoder",
            "ibm-granite-granite-4.0",
            "granite",
            "<|end_of_text|>",
            None,
            "<|end_of_text|>",
            "<|end_of_text|>",
            _GRANITE,
            reasoning=True,
            notes=_STAND_IN.format("starcoder") + "; Granite 4.0's hybrid architecture: the dense Granite class",
        ),
        Family(
            "glm-4.6",
            "llama-bpe",
            "GLM-4.6",
            "glm4",
            "<|user|>",
            None,
            "<|endoftext|>",
            "<|endoftext|>",
            _GLM,
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe") + "; an answer ends with the next turn's <|user|> (a stop token of "
            "GLM's), which the template leaves off the last one; GLM-4.5/4.6's MoE: the dense GLM-4 class",
        ),
        Family(
            "glm-4.7",
            "llama-bpe",
            "GLM-4.7-Flash",
            "glm4",
            "<|user|>",
            None,
            "<|endoftext|>",
            "<|endoftext|>",
            _GLM,
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "command-r7b",
            "llama-bpe",
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "cohere2",
            "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
            "<BOS_TOKEN>",
            "<|END_OF_TURN_TOKEN|>",
            "<PAD>",
            _COHERE,
            reasoning=True,
            notes="ggml-vocab-command-r does not rebuild exactly (VocabMismatch on '4 ½'): llama-bpe stands in; "
            "the answer closes with two tokens, the EOS last; the tool-use template renders tool-less rows too",
        ),
        Family(
            "command-a",
            "llama-bpe",
            "Cohere2MoE",
            "cohere2",
            "<|END_TEXT|><|END_OF_TURN_TOKEN|>",
            "<BOS_TOKEN>",
            "<|END_OF_TURN_TOKEN|>",
            "<PAD>",
            _COHERE,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "apertus",
            "llama-bpe",
            "Apertus-8B-Instruct",
            "apertus",
            "<|assistant_end|>",
            "<s>",
            "<|assistant_end|>",
            "<pad>",
            (
                "<s>",
                "<pad>",
                "<|system_start|>",
                "<|system_end|>",
                "<|developer_start|>",
                "<|developer_end|>",
                "<|user_start|>",
                "<|user_end|>",
                "<|assistant_start|>",
                "<|assistant_end|>",
            ),
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe") + "; <|assistant_end|> is written when the next user turn opens",
        ),
        Family(
            "seed-oss",
            "llama-bpe",
            "ByteDance-Seed-OSS",
            "seed_oss",
            "<seed:eos>",
            "<seed:bos>",
            "<seed:eos>",
            "<seed:pad>",
            ("<seed:bos>", "<seed:eos>", "<seed:pad>", "<seed:think>", "</seed:think>"),
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "kimi-k2",
            "llama-bpe",
            "moonshotai-Kimi-K2",
            "deepseek_v3",
            "<|im_end|>",
            "[BOS]",
            "[EOS]",
            "[EOS]",
            _KIMI,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; Kimi-K2 is the DeepSeek-V3 architecture",
        ),
        Family(
            "kimi-k2-thinking",
            "llama-bpe",
            "Kimi-K2-Thinking",
            "deepseek_v3",
            "<|im_end|>",
            "[BOS]",
            "[EOS]",
            "[EOS]",
            _KIMI + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; its reasoning field is reasoning_content: <think> in the "
            "content is text after the template's own empty <think></think>",
        ),
        Family(
            "lfm2",
            "llama-bpe",
            "LFM2-8B-A1B",
            "lfm2",
            "<|im_end|>",
            "<|startoftext|>",
            "<|im_end|>",
            "<|pad|>",
            ("<|startoftext|>", "<|pad|>") + _CHATML,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; LFM2-8B-A1B's MoE: the dense LFM2 class",
        ),
        Family(
            "lfm2.5",
            "llama-bpe",
            "LFM2.5-Instruct",
            "lfm2",
            "<|im_end|>",
            "<|startoftext|>",
            "<|im_end|>",
            "<|pad|>",
            ("<|startoftext|>", "<|pad|>") + _CHATML + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; drops earlier answers' reasoning, as Qwen3",
        ),
        Family(
            "qwen3-coder",
            "qwen2",
            "Qwen3-Coder",
            "qwen3",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            _QWEN,
            reasoning=True,
            notes="Qwen3-Coder's MoE: the dense Qwen3 class",
        ),
        Family(
            "qwen3.5",
            "qwen35",
            "Qwen3.5-4B",
            "qwen3",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            _QWEN + _THINK,
            reasoning=True,
            notes="Qwen3.5's hybrid architecture: the Qwen3 class",
        ),
        Family(
            "qwq",
            "qwen2",
            "Qwen-QwQ-32B",
            "qwen2",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|endoftext|>",
            _QWEN + _THINK,
            reasoning=True,
        ),
        Family(
            "deepseek-v3.1",
            "llama-bpe",
            "deepseek-ai-DeepSeek-V3.1",
            "deepseek_v3",
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            _DEEPSEEK + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; the template drops every answer's reasoning",
        ),
        Family(
            "deepseek-v3.2",
            "llama-bpe",
            "deepseek-ai-DeepSeek-V3.2",
            "deepseek_v3",
            "<｜end▁of▁sentence｜>",
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            _DEEPSEEK + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "mistral-small-3.2",
            "llama-bpe",
            "Mistral-Small-3.2-24B-Instruct-2506",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            _MISTRAL,
            notes="Tekken's vocabulary not in the sdist: llama-bpe (tiktoken-style byte-level BPE)",
        ),
        Family(
            "ministral-3-reasoning",
            "llama-bpe",
            "mistralai-Ministral-3-14B-Reasoning-2512",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            _MISTRAL + ("[THINK]", "[/THINK]"),
            reasoning=True,
            notes="Tekken's vocabulary not in the sdist: llama-bpe; Magistral-style [THINK] in its system prompt",
        ),
        Family(
            "nemotron-nano-v2",
            "llama-bpe",
            "NVIDIA-Nemotron-Nano-v2",
            "llama",
            "\n<SPECIAL_12>",
            None,
            "<SPECIAL_12>",
            "<SPECIAL_12>",
            ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
            notes=_STAND_IN.format("llama-bpe") + "; Nemotron-H's hybrid architecture: the Llama class; an answer "
            "ends with a newline and <SPECIAL_12>; its own data puts no <think> in the content (the template "
            "opens one), so the <think> conversations are left out",
        ),
        Family(
            "nemotron-3-nano",
            "llama-bpe",
            "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            "llama",
            "<|im_end|>",
            None,
            "<|im_end|>",
            "<|im_end|>",
            _CHATML + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; hybrid MoE architecture: the Llama class",
        ),
        Family(
            "apriel-1.6",
            "llama-bpe",
            "Apriel-1.6-15b-Thinker-fixed",
            "mistral",
            "\n<|end|>",
            "<s>",
            "</s>",
            None,
            ("<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>", "<|end|>"),
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe") + "; an answer ends with a newline and <|end|>, which the "
            "template writes only when another turn follows",
        ),
        Family(
            "hunyuan-3",
            "llama-bpe",
            "tencent-Hy3",
            "hunyuan_v1_dense",
            f"<｜hy_eos{_HY}",
            f"<｜hy_begin_of_sentence{_HY}",
            f"<｜hy_eos{_HY}",
            f"<｜hy_pad{_HY}",
            _HUNYUAN,
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe") + "; the template writes the EOS after the last answer only with "
            "its own is_training flag",
        ),
        Family(
            "minimax-m2",
            "llama-bpe",
            "MiniMax-M2",
            "llama",
            "[e~[",
            "]~!b[",
            "[e~[",
            "[e~[",
            ("]~!b[", "]~b]", "[e~[") + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; MoE: the Llama class",
        ),
        Family(
            "gigachat3",
            "llama-bpe",
            "GigaChat3-10B-A1.8B",
            "deepseek_v3",
            "<|message_sep|>",
            "<s>",
            "</s>",
            "</s>",
            ("<s>", "</s>", "<|role_sep|>", "<|message_sep|>"),
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "ling-3.0",
            "llama-bpe",
            "inclusionai-ling-3.0-flash",
            "llama",
            "<|role_end|>",
            None,
            "<|role_end|>",
            "<|role_end|>",
            ("<role>", "</role>", "<|role_end|>") + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; renders the reasoning trimmed, <think>r</think>answer",
        ),
        Family(
            "stepfun-3.5",
            "llama-bpe",
            "StepFun3.5-Flash",
            "llama",
            "<|im_end|>",
            "<s>",
            "<|im_end|>",
            "<|im_end|>",
            ("<s>",) + _CHATML + _THINK,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; renders the reasoning re-spaced (one newline after </think>)",
        ),
        Family(
            "solar-open",
            "llama-bpe",
            "upstage-Solar-Open-100B",
            "llama",
            "<|end|>",
            None,
            "<|end|>",
            "<|end|>",
            ("<|begin|>", "<|content|>", "<|end|>"),
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe"),
        ),
        Family(
            "reka-edge",
            "llama-bpe",
            "Reka-Edge",
            "llama",
            "\n\n<sep>",
            None,
            "<sep>",
            "<sep>",
            ("<sep>",),
            notes=_STAND_IN.format("llama-bpe") + "; an answer ends with a blank line and <sep>; the template "
            "drops <think> blocks from every answer",
        ),
        # -- from tests/test-chat-template.cpp: official templates the templates folder lacks --
        Family(
            "command-r-plus",
            "llama-bpe",
            "cpp:CohereForAI/c4ai-command-r-plus",
            "cohere",
            "<|END_OF_TURN_TOKEN|>",
            "<BOS_TOKEN>",
            "<|END_OF_TURN_TOKEN|>",
            "<PAD>",
            _COHERE,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; Command-R+'s default template (not the tool-use one)",
        ),
        Family(
            "chatglm4",
            "llama-bpe",
            "cpp:ChatGLM4",
            "glm4",
            "<|user|>",
            None,
            "<|endoftext|>",
            "<|endoftext|>",
            _GLM,
            reasoning=True,
            last_end_added=True,
            notes=_STAND_IN.format("llama-bpe") + "; GLM-4-9B-Chat's template",
        ),
        Family(
            "mistral-v7",
            "llama-bpe",
            "cpp:mistralai/Mistral-Large-Instruct-2411 (mistralai 'v7' template)",
            "mistral",
            "</s>",
            "<s>",
            "</s>",
            None,
            _MISTRAL,
            reasoning=True,
            notes=_STAND_IN.format("llama-bpe") + "; Mistral-Large-2411's 'v7' ([SYSTEM_PROMPT], ' [INST] ')",
        ),
        # -- more of models/templates, the same shapes as above on other markers --
        *[
            Family(name, vocab, template, model_type, end, bos, eos, pad, specials, reasoning=True, notes=notes)
            for name, vocab, template, model_type, end, bos, eos, pad, specials, notes in [
                (
                    "granite-4.1",
                    "starcoder",
                    "ibm-granite-granite-4.1",
                    "granite",
                    "<|end_of_text|>",
                    None,
                    "<|end_of_text|>",
                    "<|end_of_text|>",
                    _GRANITE,
                    _STAND_IN.format("starcoder"),
                ),
                (
                    "llama-3.3",
                    "llama-bpe",
                    "meta-llama-Llama-3.3-70B-Instruct",
                    "llama",
                    "<|eot_id|>",
                    "<|begin_of_text|>",
                    "<|eot_id|>",
                    "<|end_of_text|>",
                    (),
                    "",
                ),
                (
                    "functionary-v3.2",
                    "llama-bpe",
                    "meetkai-functionary-medium-v3.2",
                    "llama",
                    "<|eot_id|>",
                    "<|begin_of_text|>",
                    "<|eot_id|>",
                    "<|end_of_text|>",
                    (),
                    "answers open with '>>>all\\n'",
                ),
                (
                    "deepseek-v4",
                    "llama-bpe",
                    "deepseek-ai-DeepSeek-V4",
                    "deepseek_v3",
                    "<｜end▁of▁sentence｜>",
                    "<｜begin▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>",
                    _DEEPSEEK + _THINK,
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "kimi-k2-instruct",
                    "llama-bpe",
                    "Kimi-K2-Instruct",
                    "deepseek_v3",
                    "<|im_end|>",
                    "[BOS]",
                    "[EOS]",
                    "[EOS]",
                    _KIMI,
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "lfm2.5-moe",
                    "llama-bpe",
                    "LFM2.5-8B-A1B",
                    "lfm2",
                    "<|im_end|>",
                    "<|startoftext|>",
                    "<|im_end|>",
                    "<|pad|>",
                    ("<|startoftext|>", "<|pad|>") + _CHATML + _THINK,
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "gigachat3.1",
                    "llama-bpe",
                    "GigaChat3.1-10B-A1.8B",
                    "deepseek_v3",
                    "<|message_sep|>",
                    "<s>",
                    "</s>",
                    "</s>",
                    ("<s>", "</s>", "<|role_sep|>", "<|message_sep|>"),
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "bielik-3",
                    "llama-bpe",
                    "Bielik-11B-v3.0-Instruct",
                    "mistral",
                    "<|im_end|>",
                    "<s>",
                    "<|im_end|>",
                    "<|im_end|>",
                    ("<s>",) + _CHATML + _THINK,
                    _STAND_IN.format("llama-bpe") + "; re-spaced reasoning",
                ),
                (
                    "minicpm5",
                    "llama-bpe",
                    "openbmb-MiniCPM5-1B",
                    "llama",
                    "<|im_end|>",
                    "<s>",
                    "<|im_end|>",
                    "<|im_end|>",
                    ("<s>",) + _CHATML + _THINK,
                    _STAND_IN.format("llama-bpe"),
                ),
                ("mimo-vl", "qwen2", "MiMo-VL", "qwen2", "<|im_end|>", None, "<|im_end|>", "<|endoftext|>", _QWEN, ""),
                (
                    "spark2.5",
                    "llama-bpe",
                    "Spark2.5",
                    "llama",
                    "<｜end▁of▁sentence｜>",
                    "<｜start▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>",
                    ("<｜start▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|System|>", "<|User|>", "<|Bot|>"),
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "minimax-m1",
                    "llama-bpe",
                    "MiniMax-M1",
                    "llama",
                    "<end_of_sentence>",
                    "<begin_of_document>",
                    "<end_of_sentence>",
                    "<end_of_sentence>",
                    ("<begin_of_document>", "<beginning_of_sentence>", "<end_of_sentence>"),
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "minimax-m3",
                    "llama-bpe",
                    "MiniMax-M3",
                    "llama",
                    "[e~[",
                    "]~!b[",
                    "[e~[",
                    "[e~[",
                    ("]~!b[", "]~b]", "[e~[") + _THINK,
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "laguna-xs",
                    "llama-bpe",
                    "poolside-Laguna-XS-2.1",
                    "llama",
                    "\n</assistant>",
                    "〈|EOS|〉",
                    "〈|EOS|〉",
                    "〈|EOS|〉",
                    ("〈|EOS|〉", "<system>", "</system>", "<user>", "</user>", "<assistant>", "</assistant>") + _THINK,
                    _STAND_IN.format("llama-bpe") + "; a newline before </assistant>; re-spaced reasoning",
                ),
                (
                    "muse-glimmer",
                    "llama-bpe",
                    "muse-glimmer",
                    "llama",
                    "<|eot|>",
                    "<|begin_of_text|>",
                    "<|eot|>",
                    "<|eot|>",
                    ("<|start|>", "<|message|>", "<|eot|>"),
                    _STAND_IN.format("llama-bpe"),
                ),
                (
                    "apriel-1.5",
                    "llama-bpe",
                    "unsloth-Apriel-1.5",
                    "mistral",
                    "\n<|end|>",
                    "<s>",
                    "</s>",
                    None,
                    ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                    _STAND_IN.format("llama-bpe"),
                ),
            ]
        ],
    ]
}


# The families of issues 19/26, which the export half (tests/engine/export_conformance: GGUF through
# llama.cpp's converter, the Modelfile's Go template) checks as well; the ones after them, on stand-in
# vocabularies and architectures, are the data half's (masks, rows, X-ray).
EXPORT_FAMILIES: tuple[str, ...] = tuple(list(FAMILIES)[: list(FAMILIES).index("granite-3.3") + 1])


def conversations_for(name: str) -> dict[str, list[dict]]:
    """The corpus conversations this family's template can render as they are: reasoning ones only
    where the template parses <think>; system ones only where it accepts a system message."""
    fam = FAMILIES[name]
    return {
        k: v
        for k, v in CONVERSATIONS.items()
        if (fam.reasoning or k not in REASONING) and (fam.system or k not in WITH_SYSTEM)
    }


# -- templates ---------------------------------------------------------------------------------
_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}


def _c_string(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: _C_ESCAPES.get(m.group(1), "\\" + m.group(1)), literal)


def cpp_template(case: str) -> str:
    """The template_str of the named case in tests/test-chat-template.cpp (its C literals joined)."""
    source = (upstream.upstream_dir() / "tests" / "test-chat-template.cpp").read_text(encoding="utf-8")
    head = source.find(f'/* .name= */ "{_c_literal(case)}"')
    if head < 0:
        raise KeyError(f"test-chat-template.cpp has no case named {case!r}")
    start = source.index("/* .template_str= */", head) + len("/* .template_str= */")
    end = source.index("/* .expected_output= */", start)
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', source[start:end])
    return "".join(_c_string(p) for p in parts)


def _c_literal(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def chat_template(fam: Family) -> str:
    if fam.template.startswith("cpp:"):
        return cpp_template(fam.template[4:])
    return upstream.template(fam.template)


# -- folders -----------------------------------------------------------------------------------
_NOT_SPECIAL = frozenset({"<think>", "</think>"})


def build_tokenizer(fam: Family):
    """The family's tokenizer: its vocabulary (checked against llama.cpp), its special tokens and
    its chat template."""
    from tokenizers import AddedToken

    from tests.conformance.vocab import rebuild

    tok = rebuild(fam.vocab)
    vocab = tok.get_vocab()
    missing = [s for s in fam.specials if s not in vocab]
    if missing:
        # <think> / </think> are added tokens but not special in the real Qwen3, SmolLM3 and
        # DeepSeek-R1 tokenizers (decoding keeps them); the turn markers are special.
        tok.add_tokens(
            [AddedToken(s, special=s not in _NOT_SPECIAL, normalized=False) for s in missing], special_tokens=False
        )
    for attr in ("bos", "eos", "pad"):
        value = getattr(fam, attr)
        if value is not None:
            if value not in tok.get_vocab():
                tok.add_tokens([AddedToken(value, special=True, normalized=False)], special_tokens=True)
            setattr(tok, f"{attr}_token", value)
    # The chat template writes the BOS itself where the family has one in its template; the
    # tokenizer adds nothing when encoding a rendered conversation (add_special_tokens=False).
    tok.chat_template = chat_template(fam)
    return tok


def _tiny_config(fam: Family, vocab_size: int, tok):
    from transformers import AutoConfig

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    if fam.model_type == "gpt_oss":
        shape.update(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    if fam.model_type in ("gemma2", "gemma4_text"):
        shape.update(layer_types=["sliding_attention", "full_attention"])
    if fam.model_type == "gemma4_text":
        shape.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    cfg = AutoConfig.for_model(fam.model_type, **shape)
    for attr in ("bos", "eos", "pad"):
        token = getattr(tok, f"{attr}_token", None)
        setattr(cfg, f"{attr}_token_id", tok.convert_tokens_to_ids(token) if token else None)
    return cfg


def build_family_folder(name: str, root: Path | None = None) -> Path:
    """A model folder transformers loads (AutoTokenizer, AutoModelForCausalLM), built once and cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.export.gguf import LLAMA_CPP_PYTHON

    fam = FAMILIES[name]
    root = root or upstream.cache_root() / f"families-{LLAMA_CPP_PYTHON}-v{FOLDER_VERSION}"
    folder = root / name
    if (folder / "done.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    # A staging folder of its own, so two test processes building the same family do not mix.
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.partial-", dir=root))
    tok = build_tokenizer(fam)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(fam, len(tok), tok))
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    (staging / "done.json").write_text(json.dumps({"family": name, "vocab": fam.vocab, "template": fam.template}))
    try:
        staging.rename(folder)
    except OSError:  # another process finished it first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "done.json").is_file():
            raise
    return folder
