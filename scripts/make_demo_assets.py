"""Regenerate the bundled demo assets in resources/ (nothing is downloaded).

    python scripts/make_demo_assets.py

Writes:
- resources/demo_data/train.jsonl   instruction/input/output examples in the "Answer: ..." format
- resources/demo_data/heldout.jsonl prompts never trained on, to check the format is learned
- resources/demo_data/pretrain.txt  plain sentences stating the same facts (no chat format)
- resources/demo_model/             a tiny Llama-style model with a byte-level BPE tokenizer and
                                    a ChatML chat template, pre-trained briefly on pretrain.txt

The base model therefore knows the facts as plain prose but has never seen the chat format;
the demo fine-tune teaches it to answer chat prompts as "Answer: <value>".
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.resources import DEMO_MODEL_DIR, RESOURCES  # noqa: E402

DATA_DIR = RESOURCES / "demo_data"
SEED = 1234

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Russia": "Moscow",
    "Ukraine": "Kyiv",
    "Austria": "Vienna",
    "Hungary": "Budapest",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "Denmark": "Copenhagen",
    "Vietnam": "Hanoi",
    "Thailand": "Bangkok",
    "Nepal": "Kathmandu",
    "Ghana": "Accra",
    "Morocco": "Rabat",
    "Argentina": "Buenos Aires",
    "Colombia": "Bogota",
    "Australia": "Canberra",
    "Brazil": "Brasilia",
    "Iceland": "Reykjavik",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "light": "dark",
    "happy": "sad",
    "open": "closed",
    "early": "late",
    "full": "empty",
    "old": "new",
    "hard": "soft",
    "high": "low",
    "rich": "poor",
    "strong": "weak",
    "wet": "dry",
    "near": "far",
    "long": "short",
    "thick": "thin",
    "loud": "quiet",
    "clean": "dirty",
    "first": "last",
    "win": "lose",
    "push": "pull",
    "buy": "sell",
}
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "house",
    "music",
    "green",
    "paper",
    "light",
    "ocean",
    "plant",
    "train",
    "bread",
    "chair",
    "water",
    "night",
    "sugar",
    "glass",
    "horse",
    "candle",
    "garden",
    "window",
    "silver",
    "forest",
    "pencil",
    "rocket",
    "basket",
    "mirror",
]


def make_examples(rng: random.Random):
    """(instruction, input, output, plain sentence) tuples for each task."""
    out = []
    for a in range(2, 40):
        for b in rng.sample(range(1, 30), 4):
            out.append((f"What is {a} plus {b}?", "", f"Answer: {a + b}", f"{a} plus {b} makes {a + b}."))
            if a > b:
                out.append((f"What is {a} minus {b}?", "", f"Answer: {a - b}", f"{a} minus {b} leaves {a - b}."))
    for country, city in CAPITALS.items():
        out.append(
            (f"What is the capital of {country}?", "", f"Answer: {city}", f"The capital of {country} is {city}.")
        )
        out.append(
            (
                "Name the capital city of this country.",
                country,
                f"Answer: {city}",
                f"{city} is the capital of {country}.",
            )
        )
    for word, opp in OPPOSITES.items():
        out.append((f"What is the opposite of {word}?", "", f"Answer: {opp}", f"The opposite of {word} is {opp}."))
    for word in WORDS:
        out.append(
            ("Reverse the letters of this word.", word, f"Answer: {word[::-1]}", f"{word} backwards is {word[::-1]}.")
        )
        out.append(
            (
                f"Write {word} in capital letters.",
                "",
                f"Answer: {word.upper()}",
                f"{word} in capitals is {word.upper()}.",
            )
        )
        out.append((f"How many letters are in {word}?", "", f"Answer: {len(word)}", f"{word} has {len(word)} letters."))
    rng.shuffle(out)
    return out


def write_data(rng: random.Random):
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    examples = make_examples(rng)
    heldout, train = examples[:40], examples[40:]
    with open(DATA_DIR / "train.jsonl", "w", encoding="utf-8") as f:
        for ins, inp, outp, _ in train:
            f.write(json.dumps({"instruction": ins, "input": inp, "output": outp}) + "\n")
    with open(DATA_DIR / "heldout.jsonl", "w", encoding="utf-8") as f:
        for ins, inp, outp, _ in heldout:
            f.write(json.dumps({"instruction": ins, "input": inp, "output": outp}) + "\n")
    # The base model reads every fact, held-out ones included, as plain prose.
    sentences = [s for *_, s in examples]
    (DATA_DIR / "pretrain.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return sentences, train


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(texts, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(out_dir)
    return fast


def pretrain(model, tok, sentences, steps=400, seq=128, batch=16):
    """A short full-parameter pre-training on plain prose, so the base model knows the facts."""
    import torch

    ids = []
    rng = random.Random(SEED)
    for _ in range(6):
        order = sentences[:]
        rng.shuffle(order)
        for s in order:
            ids.extend(tok(s + "\n")["input_ids"])
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(SEED)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    sentences, train = write_data(rng)
    # The tokenizer also reads the chat-rendered examples, so "Answer:" after a newline gets
    # tokens of its own rather than being spelled out piece by piece.
    corpus = sentences + [f"{i}\n{inp}\n{o}" for i, inp, o, _ in train]

    tmp = DEMO_MODEL_DIR.with_name("demo_model.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(corpus, tmp)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    pretrain(model, tok, sentences)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(DEMO_MODEL_DIR, ignore_errors=True)
    tmp.rename(DEMO_MODEL_DIR)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {DEMO_MODEL_DIR} ({n / 1e6:.2f}M parameters, vocab {len(tok)}) and {DATA_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
