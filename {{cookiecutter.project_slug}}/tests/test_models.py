"""Models a team brings, as local folders (`model_name_or_path`): tiny checkpoints built here from each
family's own config class (random weights, no download). Built without dropout, each family trains on
2 processes with accumulation as 1 process with the whole batch trains, in every entry point (causal
ones also under FSDP2 full_shard where it is baked), and its final_model/ loads with from_pretrained.
With its own default dropout, the entry points still end equal at one world size and seed.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import (
    ACCUM,
    ENTRIES,
    GLOBAL_BATCH,
    MATRIX,
    ROOT,
    SLUG,
    TOL,
    max_abs_diff,
    max_loss_diff,
    report,
    shared_folder,
)

pytestmark = pytest.mark.slow

TOKENIZER = ROOT / "src" / SLUG / "assets" / "tokenizer"
VOCAB = len(transformers.AutoTokenizer.from_pretrained(TOKENIZER))
PAD = transformers.AutoTokenizer.from_pretrained(TOKENIZER).pad_token_id
SIZE = {"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}
DECODER = {**SIZE, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_key_value_heads": 2}
NO_DROPOUT = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
              "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "distilbert": {"dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0}}

# family: (task, config class name, its arguments); each config's own defaults otherwise
FAMILIES = {
    "gpt2": ("causal_lm", "GPT2Config", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                         "n_positions": 128}),
    "qwen2": ("causal_lm", "Qwen2Config", {**DECODER, "tie_word_embeddings": False}),
    "gemma2": ("causal_lm", "Gemma2Config", {**DECODER, "head_dim": 8, "sliding_window": 8}),
    "gemma3": ("causal_lm", "Gemma3TextConfig", {**DECODER, "head_dim": 8, "sliding_window": 8}),
    "qwen3_moe": ("causal_lm", "Qwen3MoeConfig", {**DECODER, "head_dim": 8, "moe_intermediate_size": 16,
                                                  "num_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("causal_lm", "Phi3Config", {**DECODER, "original_max_position_embeddings": 128}),
    "gpt_neox": ("causal_lm", "GPTNeoXConfig", {**DECODER, "rotary_pct": 0.25, "hidden_dropout": 0.0,
                                                "attention_dropout": 0.0}),
    "bert": ("sequence_classification", "BertConfig", {**SIZE, "vocab_size": VOCAB, "hidden_size": 32,
                                                       "intermediate_size": 64}),
    "distilbert": ("sequence_classification", "DistilBertConfig", {"vocab_size": VOCAB, "dim": 32, "n_layers": 2,
                                                                   "n_heads": 4, "hidden_dim": 64,
                                                                   "max_position_embeddings": 128}),
    "qwen2_classifier": ("sequence_classification", "Qwen2Config",
                         {**DECODER, "architectures": ["Qwen2ForSequenceClassification"]}),
}
DROPOUT_FAMILIES = ("gpt2", "bert", "distilbert")  # a default dropout of 0.1
FSDP_BAKED = (ROOT / "src" / SLUG / "fsdp.py").is_file() and "pytorch" in ENTRIES


def auto_class(task: str):
    return AutoModelForSequenceClassification if task == "sequence_classification" else AutoModelForCausalLM


def checkpoint(root: Path, family: str, dropout: bool = False) -> Path:
    """The family's tiny checkpoint with the project's tokenizer, made once for the session (every
    pytest-xdist worker sees the first one's, published by a rename)."""
    folder = root / f"{family}{'_dropout' if dropout else ''}"
    if not folder.is_dir():
        task, name, arguments = FAMILIES[family]
        config = getattr(transformers, name)(**arguments, **({} if dropout else NO_DROPOUT.get(family, {})))
        config.pad_token_id = PAD  # the project's tokenizer's, as a family's own folder has its own
        if task == "sequence_classification":
            config.num_labels = 2
        torch.manual_seed(0)
        part = root / f".{folder.name}.{os.getpid()}"
        auto_class(task).from_config(config).save_pretrained(part)
        for file in TOKENIZER.iterdir():
            shutil.copy(file, part / file.name)
        try:
            os.replace(part, folder)
        except OSError:  # another worker published it first
            shutil.rmtree(part)
    return folder


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "models")


def family_run(runs, models: Path, family: str, entry: str, nproc: int, dropout: bool = False, **flags):
    task = FAMILIES[family][0]
    micro = ACCUM["micro_batch_size"] if nproc > 1 else GLOBAL_BATCH
    return runs(entry, nproc, **MATRIX, micro_batch_size=micro, task=task,
                model_name_or_path=checkpoint(models, family, dropout), **flags)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_alike_in_every_entry_point_and_loads_again(runs, models, family, tmp_path):
    task = FAMILIES[family][0]
    whole = family_run(runs, models, family, ENTRIES[0], 1)
    params = whole.params()
    cells = {entry: family_run(runs, models, family, entry, 2) for entry in ENTRIES}
    if FSDP_BAKED and task == "causal_lm":
        cells["pytorch fsdp full_shard"] = family_run(runs, models, family, "pytorch", 2, fsdp="full_shard")
    for name, run in cells.items():
        diff, loss = max_abs_diff(run.params(), dict(params)), max_loss_diff(run, whole)
        # a divisor off by a few per cent (the Trainer's own target count is, for GPT-2) moves the gradient
        # norm, where AdamW hides it in the weights
        norm = max_loss_diff(run, whole, "grad_norm")
        report(f"model {family} {name} (2 x 4 vs 1 x 1): max |param diff| {diff:.2e}, max |loss diff| {loss:.2e}, "
               f"max |grad_norm diff| {norm:.2e}")
        assert diff <= TOL.param and loss <= TOL.loss and norm <= TOL.loss, (family, name, diff, loss, norm)
    loaded = auto_class(task).from_pretrained(whole.output_dir / "final_model")
    assert type(loaded) is type(auto_class(task).from_pretrained(checkpoint(models, family)))
    loaded.save_pretrained(tmp_path)  # the file's names (transformers renames some on load) and values again
    assert max_abs_diff(load_file(tmp_path / "model.safetensors"), dict(params)) == 0.0, family


@pytest.mark.parametrize("family", DROPOUT_FAMILIES)
def test_a_familys_own_dropout_draws_the_same_masks_in_every_entry_point(runs, models, family):
    cells = {entry: family_run(runs, models, family, entry, 2, dropout=True) for entry in ENTRIES}
    first = cells[ENTRIES[0]]
    for entry, run in cells.items():
        diff, loss = max_abs_diff(run.params(), first.params()), max_loss_diff(run, first)
        norm = max_loss_diff(run, first, "grad_norm")
        report(f"model {family} with dropout 0.1, {entry} vs {ENTRIES[0]} (2 x 4): max |param diff| {diff:.2e}, "
               f"max |grad_norm diff| {norm:.2e}")
        assert diff <= TOL.param and loss <= TOL.loss and norm <= TOL.loss, (family, entry, diff, loss, norm)
