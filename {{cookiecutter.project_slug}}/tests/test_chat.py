"""task chat: conversations rendered with the tokenizer's chat template, the loss on the tokens of
every assistant turn and on nothing else; each step divides by the assistant tokens of the whole
global batch, so accumulation, world size and entry point change nothing; what is refused."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.data import ASSISTANT, IGNORE_INDEX, TARGETS, Collator
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.prepare import prepare

from conftest import ENTRIES, FAST, MIXED_PRECISION, ROOT, SLUG, TOL, cell, max_abs_diff, max_loss_diff, report

CONFIG = str(ROOT / "configs" / "train.yaml")
CHAT = {"task": "chat"}
STORY = [{"role": "system", "content": "the robot helps me ."}, {"role": "user", "content": "show me a story ."},
         {"role": "assistant", "content": "the cat sees a dog ."}, {"role": "user", "content": "great ."},
         {"role": "assistant", "content": "bad ."}]
SHORT = [{"role": "user", "content": "a cat ."}, {"role": "assistant", "content": "one dog ."}]


def jsonl(*conversations: list) -> str:
    return "".join(json.dumps({"messages": messages}) + "\n" for messages in conversations)


def prepared(tmp_path, train: str, validation: str = jsonl(SHORT, SHORT, SHORT), **flags):
    """The chat data of these files, prepared as a run would, and the tokenizer."""
    folder = tmp_path / "data"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text(train)
    (folder / "validation.jsonl").write_text(validation)
    cfg = load_config(["--config", CONFIG, "--task", "chat", "--dataset", str(folder),
                       "--data_cache_dir", str(tmp_path / "cache"),
                       *(arg for key, value in flags.items() for arg in (f"--{key}", str(value)))])
    tokenizer = load_tokenizer(cfg)
    return prepare(cfg, tokenizer).data, tokenizer


def test_the_labels_are_the_tokens_of_every_assistant_turn_and_nothing_else(tmp_path):
    data, tokenizer = prepared(tmp_path, jsonl(STORY, SHORT))
    batch = Collator(tokenizer, "chat")([data["train"][0], data["train"][1]])
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in batch["input_ids"].tolist()]
    assert tokens[0][:16] == ["[BOS]", "<|system|>", "the", "robot", "helps", "me", ".", "[EOS]",
                              "<|user|>", "show", "me", "a", "story", ".", "[EOS]", "<|assistant|>"]
    labelled = [[i for i, label in enumerate(row) if label != IGNORE_INDEX] for row in batch["labels"].tolist()]
    # both answers of the first conversation with their EOS (positions 16-22 and 28-30), the one of
    # the second (7-10); not the system or user turns, the role tokens, or the second's padding
    assert labelled == [[*range(16, 23), *range(28, 31)], [*range(7, 11)]]
    assert [tokens[0][i] for i in labelled[0]] == ["the", "cat", "sees", "a", "dog", ".", "[EOS]", "bad", ".", "[EOS]"]
    assert [tokens[1][i] for i in labelled[1]] == ["one", "dog", ".", "[EOS]"]
    counted = batch["labels"] != IGNORE_INDEX
    assert batch["labels"][counted].equal(batch["input_ids"][counted])
    assert data["train"][TARGETS] == [10, 4]  # what each step's divisor adds up


def test_packing_keeps_each_conversations_labels(tmp_path):
    whole, _ = prepared(tmp_path / "whole", jsonl(STORY, SHORT))
    packed, _ = prepared(tmp_path / "packed", jsonl(STORY, SHORT), packing="true", max_seq_len=14)
    # 31 + 11 tokens, each conversation ending in EOS (no EOS put between them): 3 blocks of 14
    assert len(packed["train"]) == 3
    assert [t for block in packed["train"]["input_ids"] for t in block] == [t for ids in whole["train"]["input_ids"]
                                                                            for t in ids]
    assert [m for block in packed["train"][ASSISTANT] for m in block] == [m for mask in whole["train"][ASSISTANT]
                                                                          for m in mask]
    # the answers are at 16-22 and 28-30 (the first conversation), 38-41 (the second): 14 tokens, less
    # the one that opens the third block (28), which no position of its block predicts
    assert packed["train"][TARGETS] == [0, 7, 6]


LONG_QUESTION = [{"role": "user", "content": "the cat sees a dog . " * 8}, {"role": "assistant", "content": "bad ."}]
REFUSED = [  # (case, the training file, flags, what the one line says; {d} is the data folder)
    ("no_assistant_turn", jsonl(SHORT, SHORT[:1]), {}, "{d}/train.jsonl line 2: no assistant turn"),
    ("unknown_role", jsonl(SHORT, [{"role": "bot", "content": "a cat ."}, *SHORT]), {},
     "{d}/train.jsonl line 2: turn 1 has role 'bot' (str), none of system, user, assistant"),
    ("number_content", jsonl(SHORT) + "\n" + jsonl([SHORT[0], {"role": "assistant", "content": 7}]), {},
     "{d}/train.jsonl line 3: turn 2 (assistant) has content 7 (int), not a string"),
    ("null_content", jsonl(SHORT, [{"role": "user", "content": None}, SHORT[1]]), {},
     "{d}/train.jsonl line 2: turn 1 (user) has content null, not a string"),
    ("messages_not_a_list", jsonl(SHORT) + json.dumps({"messages": "a cat ."}) + "\n", {},
     "{d}/train.jsonl line 2: messages 'a cat .' (str) is not a list of role/content objects"),
    ("answer_truncated_away", jsonl(SHORT, LONG_QUESTION), {"max_seq_len": 32},
     "{d}/train.jsonl line 2: no assistant token within max_seq_len 32"),
]


@pytest.mark.parametrize("case,train,flags,expected", REFUSED, ids=[case for case, *_ in REFUSED])
def test_a_conversation_that_cannot_be_learnt_is_one_line_naming_the_file_and_line(tmp_path, case, train, flags,
                                                                                   expected):
    with pytest.raises(ConfigError) as err:
        prepared(tmp_path, train, **flags)
    assert expected.format(d=tmp_path / "data") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("marks", ["none", "no_generation_blocks"])
def test_a_tokenizer_whose_template_marks_no_answer_is_one_line(tmp_path, marks):
    tokenizer = load_tokenizer(load_config(["--config", CONFIG]))
    shipped = tokenizer.chat_template
    tokenizer.chat_template = None if marks == "none" else shipped.replace("endgeneration", "endif").replace(
        "generation", "if true")
    tokenizer.save_pretrained(tmp_path / "model")
    expected = {"none": f"the tokenizer of {tmp_path / 'model'} has no chat template",
                "no_generation_blocks": f"the chat template of {tmp_path / 'model'} has no generation blocks"}[marks]
    with pytest.raises(ConfigError, match=f"^task chat: {re.escape(expected)}; give its folder a chat_template"):
        prepared(tmp_path, jsonl(SHORT), model_name_or_path=tmp_path / "model")


def answer_positions(tokenizer, messages: list, max_seq_len: int) -> list[int]:
    """By hand, from renderings of the conversation's beginnings (not the template's generation
    blocks): assistant turn k is what the conversation up to it adds to the one before it with the
    assistant's header. Positions the truncation keeps, less position 0 (no token predicts it)."""
    def length(turns: list, **kwargs) -> int:
        return len(tokenizer.apply_chat_template(turns, **kwargs)["input_ids"])

    positions = []
    for k, turn in enumerate(messages):
        if turn["role"] == "assistant":
            positions += range(length(messages[:k], add_generation_prompt=True), length(messages[:k + 1]))
    return [p for p in positions if 0 < p < max_seq_len]


def test_each_record_counts_the_assistant_tokens_and_logs_their_loss_by_hand(runs):
    run = cell(runs, ENTRIES[0], 2, 4, **CHAT)
    cfg = load_config(["--config", CONFIG, "--task", "chat", "--max_seq_len", str(FAST["max_seq_len"])])
    tokenizer = load_tokenizer(cfg)
    train = (ROOT / "src" / SLUG / "assets" / "data" / "chat" / "train.jsonl").read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in train]
    answers = [answer_positions(tokenizer, messages, cfg.max_seq_len) for messages in conversations]
    order = np.random.default_rng([cfg.seed, 0]).permutation(len(conversations))
    windows = [order[step * 16:(step + 1) * 16] for step in range(8)]  # the global batch of each step
    assert [r["tokens"] for r in run.steps] == [sum(len(answers[i]) for i in window) for window in windows]
    # step 1's loss is the initial model's (seeded as the run's): the cross-entropy of every answer
    # token of the window, from the position before it, summed and divided by their number
    model = build_model(cfg, model_config(cfg, tokenizer)).eval()
    summed = 0.0
    for i in windows[0]:
        ids = torch.tensor(tokenizer.apply_chat_template(conversations[i])["input_ids"][:cfg.max_seq_len])
        at = torch.tensor(answers[i])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double()
        summed += F.cross_entropy(logits[at - 1], ids[at], reduction="sum").item()
    by_hand = summed / run.steps[0]["tokens"]
    report(f"chat {MIXED_PRECISION} {ENTRIES[0]} 2x4: step 1 loss {run.steps[0]['loss']:.9f}, by hand {by_hand:.9f} "
           f"over {run.steps[0]['tokens']} assistant tokens (|diff| {abs(run.steps[0]['loss'] - by_hand):.3g})")
    assert run.steps[0]["loss"] == pytest.approx(by_hand, abs=TOL.loss)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_chat_on_2_processes_x_4_micro_steps_trains_as_1_process_and_as_every_entry_point(runs, entry):
    run = cell(runs, entry, 2, 4, **CHAT)
    for name, other in (("1x1", cell(runs, entry, 1, 1, **CHAT)), (f"{ENTRIES[0]} 2x4", cell(runs, ENTRIES[0], 2, 4,
                                                                                             **CHAT))):
        assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in other.steps]
        param_diff, loss_diff = max_abs_diff(run.params(), other.params()), max_loss_diff(run, other)
        report(f"parity chat {MIXED_PRECISION} {entry} 2x4 vs {name}: max |param diff| {param_diff:.3g}, "
               f"max |loss diff| {loss_diff:.3g}")
        assert loss_diff <= TOL.loss
        assert param_diff <= TOL.param
        assert run.evals[-1]["eval_loss"] == pytest.approx(other.evals[-1]["eval_loss"], abs=TOL.loss)
    assert set(run.evals[-1]) == {"step", "eval_loss", "eval_perplexity"}
    assert run.steps[-1]["loss"] < run.steps[1]["loss"] - 0.01  # it trained (step 1 has lr 0)
