"""Write the tokenizer (with its chat template) and the small datasets that ship inside every
generated project.

Run `make assets` after changing this file; its output is committed under
`{{cookiecutter.project_slug}}/src/{{cookiecutter.project_slug}}/assets/` and copied into baked
projects without Jinja rendering (see `_copy_without_render` in cookiecutter.json).

Both datasets are synthetic, deterministic (fixed seed) and have varied lengths so padding is
real:
- causal_lm: short stories from a small grammar, 1 to 4 sentences each;
- sequence_classification: reviews whose label (1 positive, 0 negative) is set by the sentiment
  words they contain, among neutral filler, so a tiny model learns it within a CPU minute;
- chat: conversations of 1 to 3 exchanges (some opened by a system turn) in the same words: a story
  asked for and told, a review rated, a sentence repeated; the answers follow from the questions.
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "{{cookiecutter.project_slug}}" / "src" / "{{cookiecutter.project_slug}}" / "assets"
SEED = 1234
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is its role's token, the content and EOS, one turn a line. The assistant's content and
# its EOS (the model learns to stop) are inside the generation block, which transformers'
# apply_chat_template(return_assistant_tokens_mask=True) marks; trimmed, so that the block starts on
# a token (a block starting on a space marks nothing).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|> ' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ (message['content'] + ' ' + eos_token) | trim }}"
    "{% endgeneration %}{% else %}{{ message['content'] + ' ' + eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)

DETERMINERS = ["the", "a", "every", "one", "that"]
ADJECTIVES = ["small", "big", "red", "quiet", "old", "young", "green", "fast", "slow", "brave"]
NOUNS = ["cat", "dog", "bird", "child", "farmer", "robot", "river", "tree", "house", "boat",
         "teacher", "horse"]
VERBS = ["sees", "follows", "finds", "likes", "watches", "helps", "carries", "paints"]
PLACES = ["in the garden", "near the river", "at the market", "under the bridge", "on the hill",
          "by the sea"]
TIMES = ["today", "at night", "in the morning", "after the rain", "every day"]

POSITIVE = ["great", "wonderful", "excellent", "lovely", "delightful", "superb", "charming",
            "brilliant", "enjoyable", "fantastic"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "poor", "disappointing", "dull", "bad",
            "horrible", "tedious"]
FILLER = ["the", "film", "was", "and", "story", "acting", "music", "plot", "really", "quite",
          "very", "i", "found", "it", "ending", "cast", "scenes", "overall", "this", "movie",
          "with", "some", "moments", "of", "a", "book", "show", "felt", "to", "me"]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(ADJECTIVES))
    words += [rng.choice(NOUNS), rng.choice(VERBS), rng.choice(DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    if rng.random() < 0.6:
        words.append(rng.choice(PLACES))
    if rng.random() < 0.4:
        words.append(rng.choice(TIMES))
    return " ".join(words) + " ."


def story(rng: random.Random) -> dict:
    return {"text": " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))}


def review(rng: random.Random) -> dict:
    label = rng.randint(0, 1)
    polar = POSITIVE if label else NEGATIVE
    words = [rng.choice(FILLER) for _ in range(rng.randint(3, 30))]
    for _ in range(rng.randint(1, 3)):
        words.insert(rng.randint(0, len(words)), rng.choice(polar))
    return {"text": " ".join(words), "label": label}


SYSTEMS = ["the robot helps me with every story .", "i found the plot and the music of this film .",
           "the teacher helps the child with the story .", "i show one story to the child ."]
REVIEW_ANSWERS = {1: ["great .", "it was great .", "i found it lovely ."],
                  0: ["bad .", "it was bad .", "i found it dull ."]}


def subject(rng: random.Random) -> str:
    return " ".join([rng.choice(["the", "a", "one", "that"])] + ([rng.choice(ADJECTIVES)] if rng.random() < 0.5 else [])
                    + [rng.choice(NOUNS)])


def exchange(rng: random.Random) -> tuple[str, str]:
    """One question and its answer: a story about a subject, a review's verdict, or a repeat."""
    kind = rng.random()
    if kind < 0.4:
        who = subject(rng)
        told = f"{who} {rng.choice(VERBS)} {subject(rng)}" + (f" {rng.choice(PLACES)}" if rng.random() < 0.5 else "")
        return f"show me a story with {who} .", f"{told} ."
    if kind < 0.75:
        text = review(rng)
        return " ".join(text["text"].split()[:8]) + " .", rng.choice(REVIEW_ANSWERS[text["label"]])
    said = sentence(rng)
    return f"show me this story . {said}", said


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        question, answer = exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    words = sorted({w for text in texts for w in text.split()})
    vocab = {token: i for i, token in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        extra_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        padding_side="right",
        model_max_length=128,
    )


def main() -> None:
    rng = random.Random(SEED)
    splits = {
        "causal_lm": {"train": [story(rng) for _ in range(800)],
                      "validation": [story(rng) for _ in range(100)]},
        "sequence_classification": {"train": [review(rng) for _ in range(800)],
                                    "validation": [review(rng) for _ in range(200)]},
    }
    texts = []
    for task, parts in splits.items():
        for split, rows in parts.items():
            write_jsonl(ASSETS / "data" / task / f"{split}.jsonl", rows)
            texts += [row["text"] for row in rows]
    chats = {"train": [conversation(rng) for _ in range(400)], "validation": [conversation(rng) for _ in range(50)]}
    unknown = {w for rows in chats.values() for row in rows for m in row["messages"] for w in m["content"].split()}
    assert unknown <= {w for text in texts for w in text.split()}, unknown - {w for t in texts for w in t.split()}
    for split, rows in chats.items():
        write_jsonl(ASSETS / "data" / "chat" / f"{split}.jsonl", rows)
    build_tokenizer(texts).save_pretrained(ASSETS / "tokenizer")
    print(f"wrote {ASSETS}")


if __name__ == "__main__":
    main()
