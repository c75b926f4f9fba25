"""One entry point's real training, with a bare optimizer step (common.optimizer_step, on a second
copy of the model and the same micro-batches) run between each two of its steps: A, B, A, B in
one process, each timed in CPU time (time.process_time: what the process computed, not what the
machine's other load made it wait), so that a 2 % difference is resolvable on a shared machine.

The entry's time for a step is everything its loop does from handing over one window to asking
for the next (train_step, the record, the progress line, the eval/save/stop decisions, for the
Trainer its whole step with callbacks), less the time spent loading data, which neither side is
charged for. train_pytorch and train_accelerate take their windows from Session.windows; the
Trainer pulls micro-batches from the window loader itself, so it is timed at each window's first.

    python -m benchmarks.abab pytorch OUT.json --max_steps 40 ...   # the overhead benchmark runs it
"""

import json
import sys
import time
from pathlib import Path

from {{ cookiecutter.project_slug }} import session as session_module
from {{ cookiecutter.project_slug }}.cli import run_cli
from {{ cookiecutter.project_slug }}.model import build_model
from {{ cookiecutter.project_slug }}.optim import build_optimizer, build_scheduler

from .common import optimizer_step


class Interleaver:
    """Keeps the two clocks: the entry's CPU time per step, and the bare step's on the same window."""

    def __init__(self):
        self.entry_s: list[float] = []
        self.bare_s: list[float] = []
        self.handed_over = None  # process_time when the entry got its last window
        self.previous = None  # that window (kept across epochs: the Trainer asks for a new loader each)
        self.bare = None

    def hand_over(self, session, window: list[dict], loading_s: float) -> None:
        """The entry asks for `window` (loaded in `loading_s`): charge it its previous step, run the
        bare step on the previous window, and start the entry's clock again."""
        if self.previous is not None:
            self.entry_s.append(time.process_time() - self.handed_over - loading_s)
            self.bare_step(session, self.previous)
        self.previous, self.handed_over = window, time.process_time()

    def bare_step(self, session, window: list[dict]) -> None:
        if self.bare is None:
            model = build_model(session.cfg, session.run.model_config).to(session.env.device)
            optimizer = build_optimizer(model, session.cfg, session.env.device)
            self.bare = model, optimizer, build_scheduler(optimizer, session.cfg, session.run.total_steps,
                                                          session.plan)
        model, optimizer, lr_scheduler = self.bare
        start = time.process_time()
        optimizer_step(model, window, optimizer, session.cfg, session.env.device)
        lr_scheduler.step()
        self.bare_s.append(time.process_time() - start)


def interleave_windows(clock: Interleaver):
    """Session.windows, with the bare step run as each window is handed to the loop."""
    windows = session_module.Session.windows

    def timed(self, loader):
        iterator = windows(self, loader)
        while True:
            asked = time.process_time()
            try:
                window = next(iterator)
            except StopIteration:
                return
            clock.hand_over(self, window.micro_batches, time.process_time() - asked)
            yield window

    session_module.Session.windows = timed


def interleave_trainer_loader(clock: Interleaver):
    """The Trainer's window loader, timed at each window's first micro-batch (it then loads the
    window's others at once, so that their loading is not charged to the Trainer either)."""
    loaders = session_module.Session.loaders

    def timed_loaders(self):
        train, evaluation = loaders(self)
        session, plain_iter = self, type(train).__iter__

        class Timed(type(train)):
            def __iter__(loader):
                micro_batches, step = plain_iter(loader), loader.batch_sampler.start_step
                while step < session.sampler.steps_per_epoch:
                    asked = time.process_time()
                    try:
                        window = [next(micro_batches) for _ in range(session.sampler.micro_steps(step))]
                    except StopIteration:
                        return
                    clock.hand_over(session, window, time.process_time() - asked)
                    step += 1
                    yield from window

        train.__class__ = Timed
        return train, evaluation

    session_module.Session.loaders = timed_loaders


def main() -> None:
    entry, out = sys.argv[1], Path(sys.argv[2])
    del sys.argv[1:3]
    clock = Interleaver()
    (interleave_trainer_loader if entry == "trainer" else interleave_windows)(clock)
    module = __import__(f"{{ cookiecutter.project_slug }}.train_{entry}", fromlist=["train"])
    try:
        run_cli(module.train)
    finally:
        out.write_text(json.dumps({"entry_s": clock.entry_s, "bare_s": clock.bare_s}))


if __name__ == "__main__":
    main()
