"""The batch plan (windows.BatchPlan: the accumulation from the world size) and its windows: each
optimizer step's global batch and accumulation, and an epoch cut into windows as one stream of its
permutation, whatever the world size (where the global batch changes at given steps, the
batch_schedule extra's: tests/test_batch_schedule.py)."""

import pytest

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.optim import total_steps
from {{ cookiecutter.project_slug }}.windows import WindowSampler, plan_batches

from conftest import ROOT, assert_one_stream

CONFIG = str(ROOT / "configs" / "train.yaml")


@pytest.mark.parametrize("n,global_batch,micro,world", [(100, 8, 2, 2), (37, 6, 1, 3), (48, 16, 4, 2), (5, 8, 1, 4)])
def test_an_epoch_is_one_stream_of_the_permutation(n, global_batch, micro, world):
    """Each step takes the next global batch of the epoch's permutation, the last one the remainder,
    whatever the world size; every example once per epoch; epochs keep counting the run's steps."""
    plan = plan_batches(global_batch, micro, world)
    step = assert_one_stream(WindowSampler, n, plan, lambda step: global_batch, lambda step: plan.grad_accum_steps)
    cfg = load_config(["--config", CONFIG, "--max_steps", "-1", "--num_epochs", "3"])
    assert total_steps(cfg, WindowSampler(n, plan, 0, seed=3)) == step


@pytest.mark.parametrize("global_batch,micro,world,accum", [(64, 8, 1, 8), (64, 8, 2, 4), (64, 8, 8, 1),
                                                             (96, 4, 3, 8), (16, 2, 2, 4)])
def test_batch_maths(global_batch, micro, world, accum):
    plan = plan_batches(global_batch, micro, world)
    assert plan.grad_accum_steps == accum
    assert plan.global_batch_size == global_batch
    table = plan.table(max_seq_len=32)
    assert f"{accum:>10}" in table and f"{global_batch * 32:>10}" in table


def test_batch_maths_that_does_not_divide():
    with pytest.raises(ConfigError) as err:
        plan_batches(64, 8, 3)
    assert str(err.value).startswith("global_batch_size 64 is not divisible by micro_batch_size 8 x "
                                     "world_size 3 = 24")
