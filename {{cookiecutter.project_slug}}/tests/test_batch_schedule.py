"""The batch_schedule extra: a global batch that grows on a schedule, the learning rate scaled
with it, and the gradient noise scale that says which batch pays."""

import json
import subprocess
import textwrap

import pytest
import torch

from {{ cookiecutter.project_slug }}.batch_schedule import ScheduledSampler, parse_schedule, schedule_of, scheduled
from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.launch import launch_of
from {{ cookiecutter.project_slug }}.optim import build_scheduler, total_steps
from {{ cookiecutter.project_slug }}.tracking import Progress
from {{ cookiecutter.project_slug }}.windows import WindowSampler, plan_batches

from conftest import (
    ENTRIES,
    LAUNCH_TIMEOUT_S,
    ROOT,
    TOL,
    assert_one_stream,
    assert_same_training,
    launch_cmd,
    max_abs_diff,
    report,
)

CONFIG = str(ROOT / "configs" / "train.yaml")
LOOPS = [e for e in ENTRIES if e != "trainer"]  # the loops that are ours (the Trainer's is the library's)
needs_a_loop = pytest.mark.skipif(not LOOPS, reason="only train_trainer generated: it refuses a schedule")


@pytest.mark.parametrize("text,message", [
    ("0:16,4", "'4' is not STEP:SIZE"), ("0:16,x:32", "'x:32' is not STEP:SIZE"), ("2:16", "must start with 0:16"),
    ("0:32", "must start with 0:16"), ("0:16,4:32,4:64", "steps must increase, 4 follows 4"),
    ("0:16,4:24", "24 (from step 4) must be a larger multiple of 16"), ("0:16,4:8", "must be a larger multiple"),
    ("0:16,4:-32", "'4:-32' is not STEP:SIZE"),
])
def test_a_bad_schedule_is_one_line(text, message):
    with pytest.raises(ConfigError) as err:
        load_config(["--config", CONFIG, "--global_batch_size", "16", "--global_batch_size_schedule", text])
    assert message in str(err.value)



def scheduled_plan(global_batch, micro, world, schedule=()):
    return scheduled(plan_batches(global_batch, micro, world), schedule or ((0, global_batch),))


def test_the_schedule_gives_each_step_its_batch_and_accumulation():
    plan = scheduled_plan(16, 2, 2, schedule=((0, 16), (3, 32), (7, 128)))
    assert plan.schedule == ((0, 16), (3, 32), (7, 128))
    assert scheduled_plan(16, 2, 2).schedule == ((0, 16),)
    assert [plan.global_batch_at(s) for s in range(9)] == [16] * 3 + [32] * 4 + [128] * 2
    assert [plan.accum_at(s) for s in (0, 3, 7)] == [4, 8, 32]
    assert "from step 3" in plan.table(48) and "(grad_accum_steps 32)" in plan.table(48)
    assert scheduled_plan(16, 2, 2).table(48) == plan_batches(16, 2, 2).table(48)


@pytest.mark.parametrize("n,schedule,micro,world", [
    (100, ((0, 8), (3, 16), (5, 64)), 2, 2), (37, ((0, 6), (1, 12), (2, 24)), 1, 3),
    (50, ((0, 4), (20, 8)), 4, 1), (300, ((0, 16), (2, 32)), 2, 4)])
def test_a_scheduled_epoch_is_one_stream_of_the_permutation(n, schedule, micro, world):
    """Each step takes the next global batch of the epoch's permutation, whatever the world size;
    every example once per epoch; epochs keep counting the run's steps for the schedule."""
    plan = scheduled_plan(schedule[0][1], micro, world, schedule=schedule)
    step = assert_one_stream(ScheduledSampler, n, plan, plan.global_batch_at, plan.accum_at)
    cfg = load_config(["--config", CONFIG, "--max_steps", "-1", "--num_epochs", "3"])
    assert total_steps(cfg, ScheduledSampler(n, plan, 0, seed=3)) == step


@pytest.mark.parametrize("n,global_batch,micro,world", [(100, 8, 2, 2), (37, 6, 1, 3), (5, 8, 1, 4)])
def test_a_schedule_of_one_size_gives_the_windows_of_one_global_batch(n, global_batch, micro, world):
    plain = WindowSampler(n, plan_batches(global_batch, micro, world), world - 1, seed=3)
    sampler = ScheduledSampler(n, scheduled_plan(global_batch, micro, world), world - 1, seed=3)
    assert [sampler.first_step(e) for e in range(4)] == [plain.first_step(e) for e in range(4)]
    for done in range(3 * plain.steps_per_epoch + 1):
        assert sampler.epoch_of(done) == plain.epoch_of(done)
        assert sampler.window_at(done).examples.tolist() == plain.window_at(done).examples.tolist()
        assert sampler.window_at(done).ends_epoch == plain.window_at(done).ends_epoch
        epoch, step = plain.epoch_of(done)
        assert sampler.window(epoch, step) == plain.window(epoch, step)
    sampler.set_epoch(2, start_step=1)
    plain.set_epoch(2, start_step=1)
    assert list(sampler) == list(plain) and len(sampler) == len(plain)


def test_a_schedule_is_read_with_spaces():
    assert parse_schedule(" 0:16, 3:32 ,7:128", 16) == ((0, 16), (3, 32), (7, 128))


@pytest.mark.parametrize("scaling,power", [("none", 0.0), ("sqrt", 0.5), ("linear", 1.0)])
def test_lr_batch_scaling(scaling, power):
    cfg = load_config(["--config", CONFIG, "--global_batch_size", "16", "--warmup_steps", "2",
                       "--lr_scheduler_type", "constant", "--global_batch_size_schedule", "0:16,3:32,5:128",
                       "--lr_batch_scaling", scaling])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    plan = scheduled(plan_batches(16, 2, 1), parse_schedule(cfg.global_batch_size_schedule, 16))
    scheduler = build_scheduler(optimizer, cfg, 8, plan)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    base = [0.0, 0.5, 1, 1, 1, 1, 1]
    factor = [1, 1, 1, 2**power, 2**power, 8**power, 8**power]
    assert lrs == pytest.approx([cfg.learning_rate * b * f for b, f in zip(base, factor, strict=True)], rel=1e-12)


def test_the_trainer_and_deepspeed_refuse_a_schedule():
    cfg = load_config(["--config", CONFIG, "--global_batch_size", "16", "--global_batch_size_schedule", "0:16,2:32"])
    with pytest.raises(ConfigError, match="^train_trainer cannot follow global_batch_size_schedule"):
        schedule_of(cfg, launch_of(cfg, "trainer"))
    cfg.deepspeed = "configs/deepspeed/zero2.json"
    with pytest.raises(ConfigError, match="^global_batch_size_schedule with DeepSpeed"):
        schedule_of(cfg, launch_of(cfg, "accelerate"))


def test_the_progress_line_shows_the_noise_scale_and_a_new_batch():
    progress = Progress(total_steps=3, start_step=0, log_every=1)
    record = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100, "elapsed_s": 1.0,
              "global_batch_size": 16, "micro_batch_size": 4, "grad_accum_steps": 2, "world_size": 2,
              "grad_noise_scale": 12.34}
    assert progress.line(record).endswith("| gns 12.3")
    progress.update(record)
    record = {**record, "step": 2, "micro_batch_size": 2, "grad_accum_steps": 4, "oom_retries": 1}
    assert progress.line(record).endswith("| batch 16 = micro 2 after out of memory x accum 4 x world 2")


# --- 2 processes --------------------------------------------------------------------------------

SCHEDULED = {"global_batch_size": 8, "global_batch_size_schedule": "0:8,2:16,4:32", "max_steps": 6,
             "lr_batch_scaling": "sqrt", "ddp_bucket_cap_mb": 0.05}


@pytest.mark.slow
@needs_a_loop
def test_a_scheduled_run_trains_like_one_process_and_resumes_across_a_change(runs, tmp_path):
    """2 processes x 2 rows per micro-batch (accumulation 2, 4, 8) against one process taking each
    global batch at once; the entries agree; a job stopped after step 3 (inside the second size)
    resumes bitwise, noise-scale estimate included."""
    reference = runs(LOOPS[0], 1, micro_batch_size=8, **SCHEDULED)
    assert [(r["global_batch_size"], r["grad_accum_steps"]) for r in reference.steps] == \
        [(8, 1), (8, 1), (16, 2), (16, 2), (32, 4), (32, 4)]
    for entry in LOOPS:
        run = runs(entry, 2, micro_batch_size=2, **SCHEDULED)
        assert [(r["global_batch_size"], r["grad_accum_steps"], r["micro_steps"]) for r in run.steps] == \
            [(8, 2, 2), (8, 2, 2), (16, 4, 4), (16, 4, 4), (32, 8, 8), (32, 8, 8)]
        assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in reference.steps]
        assert [r["lr"] for r in run.steps] == [r["lr"] for r in reference.steps]
        diff = max_abs_diff(run.params(), reference.params())
        report(f"schedule {entry} 2 processes x micro 2 vs 1 process x whole batch: max |param diff| {diff:.3g}")
        assert diff <= TOL.param
        assert all(r["grad_noise_scale"] > 0 for r in run.steps[2:])  # the estimate exists from step 2 or so
    stopped = runs.run(LOOPS[0], 2, tmp_path / "resumed",
                       {"micro_batch_size": 2, **SCHEDULED, "save_steps": 1, "stop_after_steps": 3})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = runs.run(LOOPS[0], 2, tmp_path / "resumed",
                       {"micro_batch_size": 2, **SCHEDULED, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = runs(LOOPS[0], 2, micro_batch_size=2, **SCHEDULED)
    assert_same_training(resumed, straight)
    assert [r["grad_noise_scale"] for r in resumed.steps[3:]] == [r["grad_noise_scale"] for r in straight.steps[3:]]


NOISE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from {{ cookiecutter.project_slug }}.distributed import dist_env, init_distributed, wrap_ddp
    from {{ cookiecutter.project_slug }}.noise import NoiseScale, NoisyGradSyncCounter, read_norms

    env = dist_env()
    init_distributed(env, 60, 60)
    d, n, sigma, batch, steps = 16, 8192, 0.5, 64, int(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w_star + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    model = torch.nn.Linear(d, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)  # measured at w = 0, where the gradient is -E[x y]
    ddp = wrap_ddp(model, env, 25)
    counter, noise = NoisyGradSyncCounter(ddp), NoiseScale()
    sq_norms, traces, smoothed = [], [], None
    for step in range(steps):
        # the same i.i.d. draw (with replacement) on every rank; rank r takes every world_size-th example
        draw = torch.randint(n, (batch,), generator=torch.Generator().manual_seed(1000 + step))
        rows = draw[env.rank::env.world_size]
        ddp.zero_grad(set_to_none=True)
        residual = ddp(x[rows]).squeeze(1) - y[rows]
        # as the entry points scale it: the rank's summed loss / the global batch x world_size
        (0.5 * residual.square().sum() * env.world_size / batch).backward()
        values = noise.update(*read_norms(*counter.take_norms(), env.world_size), batch, env.world_size)
        sq_norms.append(values["grad_sq_norm"])
        traces.append(values["grad_trace"])
        smoothed = values.get("grad_noise_scale", smoothed)
    per_example = x * (-y)[:, None]  # the gradient of 0.5 (x.w - y)^2 at w = 0, per example
    mean = per_example.mean(0)
    exact = ((per_example - mean).square().sum(1).mean() / mean.square().sum()).item()
    closed = ((d + 1) * w_star.square().sum() + d * sigma ** 2) / w_star.square().sum()
    if env.rank == 0:
        print(json.dumps(dict(estimate=sum(traces) / sum(sq_norms), exact=exact, closed_form=closed.item(),
                              smoothed_last=smoothed)))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_the_noise_scale_estimator_against_the_closed_form(runs, tmp_path):
    """Linear regression with Gaussian inputs and noise, at w = 0: B_simple = tr(Σ)/|G|² is
    (d+1) + d σ²/|w*|² in closed form, and exactly computable from the per-example gradients of
    the finite set. The estimator, from the real DDP hook on 2 processes (per-rank batch 32, global
    64), averaged over 400 steps, must land within 10 % of it."""
    script = tmp_path / "noise.py"
    script.write_text(NOISE_SCRIPT)
    proc = subprocess.run(launch_cmd(ENTRIES[0], 2, (script, 400)), cwd=ROOT, env=runs.env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    error = abs(result["estimate"] / result["exact"] - 1)
    report(f"noise scale: estimate {result['estimate']:.3f} vs exact {result['exact']:.3f} (closed form "
           f"{result['closed_form']:.3f}): {error:.1%} off; smoothed at the end {result['smoothed_last']:.3f}")
    assert abs(result["exact"] / result["closed_form"] - 1) < 0.05  # the finite set is close to its law
    assert error < 0.10

