"""A model of a team's own through `model_factory` (tests/helpers/factory_models.py: an embedding, a GRU
and a tied head, no Hugging Face class): it trains alike in every entry point, stops and resumes
exactly, and its final_model/ rebuilds it; a factory that cannot give such a model, or a model that
lacks what an option needs, is one line and exit code 2 at start.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.project_slug }}.config import TrainConfig
from {{ cookiecutter.project_slug }}.errors import ConfigError
from {{ cookiecutter.project_slug }}.model import FACTORY_FILE, build_model, load_tokenizer, model_config, rebuild_model

from conftest import (
    ACCUM,
    ENTRIES,
    RunCache,
    assert_same_training,
    max_loss_diff,
    one_error_line,
    run_entry,
    shared_folder,
)
from helpers import factory_models

FACTORY = "helpers.factory_models:gru"
TESTS = str(Path(__file__).parent)  # holds helpers/
FLAGS = {**ACCUM, "model_factory": FACTORY, "peak_tflops": 1}  # a peak, yet no FLOP count: no mfu


def with_tests(env: dict) -> dict:
    """The environment with this folder importable, as a team's model package would be."""
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], TESTS])
    return env


@pytest.fixture(scope="module")
def factory_runs(tmp_path_factory) -> RunCache:
    runs = RunCache(shared_folder(tmp_path_factory, "factory_runs"))
    with_tests(runs.env)
    return runs


@pytest.mark.slow
def test_a_plain_module_trains_alike_in_every_entry_point_and_final_model_rebuilds_it(factory_runs):
    runs = {entry: factory_runs(entry, 2, **FLAGS) for entry in ENTRIES}
    first = runs[ENTRIES[0]]
    params = first.params()
    assert "head.weight" not in params  # tied to embed.weight: saved once
    for entry, run in runs.items():
        assert [r["step"] for r in run.steps] == list(range(1, 9)), entry
        assert not any("mfu" in r for r in run.steps), entry
        assert [e["step"] for e in run.evals] == [8] and "eval_perplexity" in run.evals[0], entry
        assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in first.steps], entry
        other = run.params()
        assert other.keys() == params.keys(), entry
        assert max((other[k] - params[k]).abs().max().item() for k in params) <= 1e-6, entry
        assert max_loss_diff(run, first) <= 1e-6, entry
        # the step's divisor alike (AdamW would hide one off by a few per cent in the weights)
        assert max_loss_diff(run, first, "grad_norm") <= 1e-6, entry
        assert (run.output_dir / "final_model" / "tokenizer.json").is_file(), entry

    folder = first.output_dir / "final_model"
    recipe = json.loads((folder / FACTORY_FILE).read_text())
    assert (recipe["model_factory"], recipe["num_labels"]) == (FACTORY, None)
    rebuilt = rebuild_model(folder)
    assert isinstance(rebuilt, factory_models.TinyGRU) and rebuilt.head.weight is rebuilt.embed.weight
    by_hand = factory_models.gru(vocab_size=recipe["vocab_size"], num_labels=None, cfg=None)
    by_hand.load_state_dict(params, strict=False)
    by_hand.head.weight = by_hand.embed.weight
    tokens = torch.arange(12).view(2, 6) % recipe["vocab_size"]
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens), by_hand(tokens))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_plain_module_stops_and_resumes_exactly(factory_runs, entry, tmp_path):
    straight = factory_runs(entry, 2, **FLAGS)
    out = tmp_path / "resumed"
    first = factory_runs.run(entry, 2, out, {**FLAGS, "stop_after_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (out / "final_model").exists()
    second = factory_runs.run(entry, 2, out, {**FLAGS, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_training(second, straight)


def test_a_plain_classifier_trains_and_evaluates(env, tmp_path):
    out = tmp_path / "out"
    flags = {"task": "sequence_classification", "model_factory": FACTORY, "max_steps": 2,
             "global_batch_size": 8, "micro_batch_size": 4}
    run = run_entry(ENTRIES[-1], 1, out, with_tests(env), flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.steps] == [1, 2]
    assert "eval_accuracy" in run.evals[-1] and "eval_f1" in run.evals[-1]
    assert json.loads((out / "final_model" / FACTORY_FILE).read_text())["num_labels"] == 2


UNUSED = {**FLAGS, "model_factory": "helpers.factory_models:unused_pooler"}


@pytest.mark.parametrize("entry", [ENTRIES[0], *(pytest.param(e, marks=pytest.mark.slow) for e in ENTRIES[1:])])
def test_a_parameter_without_gradient_is_refused_before_the_first_step(entry, env, tmp_path):
    """DDP reduces no bucket that holds a parameter the forward left unused: refused at the end of the
    first backward that synchronises, on every rank, before any optimizer step or record."""
    out = tmp_path / "out"
    run = run_entry(entry, 2, out, with_tests(env), {**UNUSED, "max_steps": 2})
    assert "exitcode  : 2" in run.stderr, run.stderr[-3000:]  # each worker's; 1 is torchrun's own
    one_error_line(run, "error: pooler.weight, pooler.bias got no gradient in a micro-step where DDP synchronises, so "
                        "DDP would leave it unsynchronised; set ddp_find_unused_parameters", code=1, workers=2)
    assert run.steps == []


@pytest.mark.slow
def test_a_parameter_without_gradient_trains_exactly_where_ddp_looks_for_it(factory_runs):
    """With ddp_find_unused_parameters, every entry point on 2 processes with accumulation ends where one
    process with the whole batch ends: the pooler keeps no gradient, so weight decay leaves it alone."""
    flags = {**UNUSED, "ddp_find_unused_parameters": True}
    whole = factory_runs(ENTRIES[0], 1, **{**flags, "micro_batch_size": FLAGS["global_batch_size"]})
    params = whole.params()
    for entry in ENTRIES:
        run = factory_runs(entry, 2, **flags)
        assert [r["step"] for r in run.steps] == list(range(1, 9)), entry
        other = run.params()
        assert other.keys() == params.keys(), entry
        assert max((other[k] - params[k]).abs().max().item() for k in params) <= 1e-5, entry
        assert max_loss_diff(run, whole) <= 1e-5, entry


BAD_FACTORIES = [
    ({"model_factory": "helpers.factory_models.gru"},
     "model_factory 'helpers.factory_models.gru' is not 'package.module:function'"),
    ({"model_factory": "no_such_package.models:gru"},
     "cannot import no_such_package.models (ModuleNotFoundError: No module named 'no_such_package')"),
    ({"model_factory": "helpers.factory_models:nothing"}, "factory_models has no function nothing"),
    ({"model_factory": "helpers.factory_models:NOT_CALLABLE"}, "factory_models has no function NOT_CALLABLE"),
    ({"model_factory": "helpers.factory_models:not_a_module"}, "returned a dict, not a torch.nn.Module"),
    ({"model_factory": "helpers.factory_models:positional"},
     "(vocab_size=..., num_labels=..., cfg=...) failed (TypeError: "),
    ({"model_factory": "helpers.factory_models:wrong_vocab"}, "expected [1, 2, 108] (the last size is vocab_size)"),
    ({"model_factory": "helpers.factory_models:wrong_vocab", "task": "sequence_classification"},
     "expected [1, 2] (the last size is num_labels)"),
    ({"model_factory": FACTORY, "gradient_checkpointing": True},
     f"gradient_checkpointing: the model_factory '{FACTORY}' model has no gradient_checkpointing_enable()"),
]


@pytest.mark.parametrize("case", range(len(BAD_FACTORIES)))
def test_a_bad_factory_is_refused_in_one_line(case, monkeypatch, tmp_path):
    """Each mistake, found where the entry points find it: the factory's name at start
    (model_config), its model when it is built (build_model), before any process waits on another."""
    flags, message = BAD_FACTORIES[case]
    monkeypatch.syspath_prepend(TESTS)
    cfg = TrainConfig(**{"output_dir": str(tmp_path), **flags})
    with pytest.raises(ConfigError) as refused:
        build_model(cfg, model_config(cfg, load_tokenizer(cfg)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("case", [0, 6])  # at start, and when the model is built
def test_a_bad_factory_exits_2_with_one_line(case, env, tmp_path):
    flags, message = BAD_FACTORIES[case]
    run = run_entry(ENTRIES[case % len(ENTRIES)], 1, tmp_path / "out", with_tests(env), {"max_steps": 2, **flags})
    one_error_line(run, message)


def test_fsdp_needs_the_models_layer_classes(monkeypatch, tmp_path):
    """Accelerate's FSDP config (and train_pytorch's fsdp) wraps each of _no_split_modules' layers:
    refused up front for a model without them (on CPU the launch itself refuses FSDP first)."""
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    cfg = TrainConfig(model_factory=FACTORY, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=f"fsdp: the model_factory '{FACTORY}' model has no _no_split"):
        build_model(cfg, type("Config", (), {"vocab_size": 11, "num_labels": 2})())
