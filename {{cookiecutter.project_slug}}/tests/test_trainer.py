"""The Trainer entry point: per-epoch evaluation with compute_metrics, launch through
`accelerate launch`, and DeepSpeed ZeRO-2 and ZeRO-3 on CPU with the same training as DDP."""

import pytest

from conftest import ROOT, accelerate_launch, max_abs_diff, report

SGD = {"optimizer": "sgd", "learning_rate": 0.1, "max_grad_norm": 0,
       "micro_batch_size": 2, "global_batch_size": 16, "max_steps": 4}

pytestmark = pytest.mark.slow  # the fast tier (`make test`) leaves this module to `make test-all`


def test_classification_metrics_once_per_epoch(runs):
    run = runs("trainer", 2, task="sequence_classification", num_epochs=2)
    steps_per_epoch = len(run.steps) // 2
    assert [e["step"] for e in run.evals] == [steps_per_epoch, 2 * steps_per_epoch]
    for record in run.evals:
        assert set(record) == {"step", "eval_loss", "eval_accuracy", "eval_f1"}
    report(f"trainer sequence_classification eval_accuracy per epoch: {[e['eval_accuracy'] for e in run.evals]}")
    assert run.evals[-1]["eval_accuracy"] >= 0.9  # chance is about 0.5


def test_trainer_under_accelerate_launch(env, tmp_path):
    config = "multi_gpu" if (ROOT / "configs" / "accelerate").is_dir() else None
    run = accelerate_launch(config, 2, env, tmp_path / "out", "--max_steps", "2", "--micro_batch_size", "2",
                            "--global_batch_size", "8", entry="trainer")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(r["step"], r["world_size"], r["grad_accum_steps"]) for r in run.steps] == [(1, 2, 2), (2, 2, 2)]


@pytest.mark.skipif(not (ROOT / "configs" / "deepspeed").is_dir(), reason="deepspeed_stage: none")
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_trainer_deepspeed_trains_like_ddp(runs, stage):
    ddp = runs("trainer", 2, **SGD)
    ds = runs("trainer", 2, deepspeed=f"configs/deepspeed/{stage}.json", **SGD)
    assert [r["step"] for r in ds.steps] == [1, 2, 3, 4]
    assert "grad_sync_calls" not in ds.steps[0]
    for a, b in zip(ddp.steps, ds.steps, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    diff = max_abs_diff(ddp.params(), ds.params())
    report(f"DeepSpeed {stage} vs DDP (trainer, 2x4, SGD): max |param diff| {diff:.3g}")
    assert diff <= 1e-5
