"""The recipes of docs/extending.md, each done on a copy of this project the way a team does it:
a prompt mask in the labelling rule (data.labels_for) and a metric added to evaluation.eval_metrics
train alike in every entry point, each step's divisor counting exactly the labels the loss sees; a
schedule with a floor (min_lr_ratio) decays to it and never below."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_model

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.optim import build_scheduler
from {{ cookiecutter.project_slug }}.windows import plan_batches

from conftest import ENTRIES, ROOT, SLUG, TOL, max_abs_diff, offline_env, one_error_line, run_entry

CONFIG = str(ROOT / "configs" / "train.yaml")
PROMPT = 3  # the first tokens of each example that the prompt mask leaves out of the loss
EDITS = {  # file of the package: (what is there, what the recipe puts in its place)
    "data.py": ('    labels = torch.tensor(example["input_ids"], dtype=torch.long)\n',
                '    labels = torch.tensor(example["input_ids"], dtype=torch.long)\n'
                f'    labels[:{PROMPT}] = IGNORE_INDEX\n'),
    "evaluation.py": ("    return metrics\n",
                      '    metrics["eval_bits_per_target"] = loss / math.log(2)\n    return metrics\n'),
}
# The whole training set (36 examples) in every step, 4 micro-steps of 9 (padding in each), plain
# SGD (a mis-scaled step shows whole), a cosine schedule with a floor; an evaluation after each step.
FLAGS = {"task": "causal_lm", "global_batch_size": 36, "micro_batch_size": 9, "max_steps": 4, "optimizer": "sgd",
         "learning_rate": 0.1, "lr_scheduler_type": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1,
         "eval_every": 1, "save_steps": 1, "save_total_limit": 0}


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """A copy of the package with the recipes' edits, the data its runs train on, and the
    environment that runs the copy."""
    root = tmp_path_factory.mktemp("team")
    package = shutil.copytree(ROOT / "src" / SLUG, root / "src" / SLUG, ignore=shutil.ignore_patterns("__pycache__"))
    for name, (there, recipe) in EDITS.items():
        source = (package / name).read_text()
        assert source.count(there) == 1, name
        (package / name).write_text(source.replace(there, recipe))
    data = root / "data"
    data.mkdir()
    source = ROOT / "src" / SLUG / "assets" / "data" / "causal_lm"
    for split, n in (("train", 36), ("validation", 7)):
        rows = (source / f"{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    env = offline_env(root)
    env["PYTHONPATH"] = str(root / "src")
    return env, data


def hand_loss(checkpoint, data, cfg) -> tuple[float, int]:
    """The loss of the whole training set under `checkpoint`'s weights, by hand: each example alone
    (no padding), cross-entropy summed over the tokens after the prompt, over their number."""
    tokenizer = load_tokenizer(cfg)
    model = build_model(cfg, model_config(cfg, tokenizer))
    load_model(model, str(checkpoint / "model.safetensors"))
    total, count = 0.0, 0
    with torch.no_grad():
        for line in (data / "train.jsonl").read_text().splitlines():
            ids = tokenizer(json.loads(line)["text"], truncation=True, max_length=cfg.max_seq_len)
            ids = torch.tensor(ids["input_ids"])
            logits = model(input_ids=ids[None]).logits[0].float()
            total += F.cross_entropy(logits[PROMPT - 1:-1], ids[PROMPT:], reduction="sum").item()
            count += max(len(ids) - PROMPT, 0)
    return total / count, count


def expected_lr(step: int, lr: float, warmup: int, total: int, kind: str, floor: float) -> float:
    """The schedule by hand: linear warmup from 0, then linear or cosine decay from lr to floor x lr."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    decay = max(0.0, 1 - progress) if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return lr * (floor + (1 - floor) * decay)


@pytest.mark.slow
def test_a_prompt_mask_and_a_metric_added_the_documented_way_train_alike_in_every_entry_point(team, env, tmp_path):
    team_env, data = team
    flags = {**FLAGS, "dataset": data}
    done = {entry: run_entry(entry, 1, tmp_path / entry, team_env, {**flags, "save_steps": int(entry == ENTRIES[0])})
            for entry in ENTRIES}  # step 2's checkpoint of the first, for the hand computation
    for entry, run in done.items():
        assert run.returncode == 0, (entry, run.stderr[-3000:])
    cfg = load_config(["--config", CONFIG, *[a for k, v in flags.items() for a in (f"--{k}", str(v))],
                       "--max_seq_len", "48"])
    loss, targets = hand_loss(tmp_path / ENTRIES[0] / "checkpoints" / "step_2", data, cfg)
    reference = done[ENTRIES[0]]
    for entry, run in done.items():
        steps = run.steps
        assert [r["tokens"] for r in steps] == [targets] * FLAGS["max_steps"], entry  # the unmasked labels
        assert steps[2]["loss"] == pytest.approx(loss, abs=TOL.loss), entry  # step 3, from step 2's weights
        assert [r["lr"] for r in steps] == pytest.approx(
            [expected_lr(s, 0.1, 1, FLAGS["max_steps"], "cosine", 0.1) for s in range(FLAGS["max_steps"])]), entry
        assert min(r["lr"] for r in steps[1:]) >= 0.1 * 0.1 * (1 - 1e-9)
        assert len(run.evals) == FLAGS["max_steps"], entry
        for record in run.evals:  # the metric added in one place, in every entry point's eval records
            assert record["eval_bits_per_target"] == pytest.approx(record["eval_loss"] / math.log(2)), entry
        for a, b in zip(reference.steps, steps, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=TOL.loss)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=max(1e-5, TOL.loss))
        for a, b in zip(reference.evals, run.evals, strict=True):
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=TOL.loss)
        assert max_abs_diff(reference.params(), run.params()) <= TOL.param, entry
    # the rule changed back (this project's own): a resume of the masked run is refused in one line
    out = shutil.copytree(tmp_path / ENTRIES[0], tmp_path / "resumed")
    shutil.rmtree(out / "final_model")
    refused = run_entry(ENTRIES[0], 1, out, env, {**flags, "resume_from_checkpoint": "auto"})
    one_error_line(refused, f"was trained on other data than dataset {data} holds now")


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
def test_the_schedule_decays_to_min_lr_ratio_and_never_below(kind):
    cfg = load_config(["--config", CONFIG, "--lr_scheduler_type", kind, "--warmup_steps", "2", "--min_lr_ratio",
                       "0.1", "--learning_rate", "0.5"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    scheduler = build_scheduler(optimizer, cfg, 10, plan_batches(16, 16, 1))
    lrs = []
    for _ in range(11):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    if kind == "constant":  # unaffected: the peak after warmup
        assert lrs == pytest.approx([0.0, 0.25] + [0.5] * 9)
        return
    assert lrs == pytest.approx([expected_lr(s, 0.5, 2, 10, kind, 0.1) for s in range(11)])
    assert lrs[-1] == pytest.approx(0.05) and min(lrs[2:]) >= 0.05 * (1 - 1e-12)
