"""The batch plan and its windows: each optimizer step's global batch and accumulation, and an
epoch cut into windows as one stream of its permutation, whatever the world size, also where the
global batch changes at given steps (the batch_schedule extra's schedule: tests/test_batch_schedule.py)."""

import pytest

from {{ cookiecutter.project_slug }}.batch import plan_batches
from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.optim import total_steps
from {{ cookiecutter.project_slug }}.windows import WindowSampler

from conftest import ROOT

CONFIG = str(ROOT / "configs" / "train.yaml")


def test_the_schedule_gives_each_step_its_batch_and_accumulation():
    plan = plan_batches(16, 2, 2, schedule=((0, 16), (3, 32), (7, 128)))
    assert plan.schedule == ((0, 16), (3, 32), (7, 128))
    assert plan_batches(16, 2, 2).schedule == ((0, 16),)
    assert [plan.global_batch_at(s) for s in range(9)] == [16] * 3 + [32] * 4 + [128] * 2
    assert [plan.accum_at(s) for s in (0, 3, 7)] == [4, 8, 32]
    assert "from step 3" in plan.table(48) and "(grad_accum_steps 32)" in plan.table(48)


@pytest.mark.parametrize("n,schedule,micro,world", [
    (100, ((0, 8), (3, 16), (5, 64)), 2, 2), (37, ((0, 6), (1, 12), (2, 24)), 1, 3),
    (50, ((0, 4), (20, 8)), 4, 1), (300, ((0, 16), (2, 32)), 2, 4)])
def test_a_scheduled_epoch_is_one_stream_of_the_permutation(n, schedule, micro, world):
    """Each step takes the next global batch of the epoch's permutation, whatever the world size;
    every example once per epoch; epochs keep counting the run's steps for the schedule."""
    plan = plan_batches(schedule[0][1], micro, world, schedule=schedule)
    ranks = [WindowSampler(n, plan, rank, seed=3) for rank in range(world)]
    step = 0
    for epoch in range(3):
        sampler = ranks[0]
        assert sampler.epoch_of(step) == (epoch, 0) and sampler.first_step(epoch) == step
        order, offset = sampler.permutation(epoch).tolist(), 0
        for s, size in enumerate(sampler.epoch_sizes(epoch)):
            assert size == min(plan.global_batch_at(step), n - offset)
            assert len(sampler.window_at(step).examples) == size and sampler.epoch_of(step) == (epoch, s)
            windows = [r.window(epoch, s) for r in ranks]
            assert len({len(w) for w in windows}) == 1
            if size == plan.global_batch_at(step):
                assert len(windows[0]) == plan.accum_at(step)
            real = sorted(i for w in windows for mb in w for i, keep in mb if keep)
            assert real == sorted(order[offset:offset + size])
            offset, step = offset + size, step + 1
        assert offset == n
    cfg = load_config(["--config", CONFIG, "--max_steps", "-1", "--num_epochs", "3"])
    assert total_steps(cfg, WindowSampler(n, plan, 0, seed=3)) == step
