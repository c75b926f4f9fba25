"""The batch plan (windows.BatchPlan: the accumulation from the world size) and its windows: each
optimizer step's global batch and accumulation, and an epoch cut into windows as one stream of its
permutation, whatever the world size (where the global batch changes at given steps, the
batch_schedule extra's: tests/test_batch_schedule.py)."""

import numpy as np
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


def samplers(n, global_batch, micro, world, seed=7):
    plan = plan_batches(global_batch, micro, world)
    return [WindowSampler(n, plan, rank, seed) for rank in range(world)]


@pytest.mark.parametrize("n,global_batch,micro,world", [
    (100, 16, 2, 2), (100, 16, 16, 1), (37, 16, 2, 2), (37, 12, 1, 4), (50, 24, 4, 3), (5, 8, 1, 8),
])
def test_windows_cover_each_epoch_exactly_once(n, global_batch, micro, world):
    ranks = samplers(n, global_batch, micro, world)
    reference = samplers(n, global_batch, global_batch, 1)[0]
    for epoch in (0, 1):
        order = ranks[0].permutation(epoch)
        assert order.tolist() == reference.permutation(epoch).tolist()  # world size does not matter
        seen = []
        for step in range(ranks[0].steps_per_epoch):
            windows = [s.window(epoch, step) for s in ranks]
            assert len({len(w) for w in windows}) == 1  # same number of micro-steps on every rank
            real = sorted(i for w in windows for mb in w for i, keep in mb if keep)
            assert real == sorted(order[step * global_batch:(step + 1) * global_batch].tolist())
            assert all(len(mb) <= micro for w in windows for mb in w)
            seen += real
        assert sorted(seen) == list(range(n))
    assert ranks[0].permutation(0).tolist() != ranks[0].permutation(1).tolist()


def test_full_windows_have_grad_accum_steps_micro_batches():
    sampler = samplers(100, 16, 2, 2)[0]
    assert [sampler.micro_steps(s) for s in range(7)] == [4, 4, 4, 4, 4, 4, 1]


def test_resume_position_skips_the_consumed_windows():
    sampler = samplers(100, 16, 2, 2)[1]
    sampler.set_epoch(3)
    everything = list(sampler)
    sampler.set_epoch(3, start_step=2)
    assert list(sampler) == everything[2 * 4:]
    assert len(sampler) == len(everything) - 8


def test_the_permutation_is_drawn_once_per_epoch(monkeypatch):
    sampler = samplers(1000, 16, 2, 2)[0]
    drawn = []
    generator = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed: drawn.append(seed) or generator(seed))
    for epoch in (0, 0, 1):
        sampler.set_epoch(epoch)
        assert len(list(sampler)) == len(sampler)
    assert drawn == [[7, 0], [7, 1]]


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
