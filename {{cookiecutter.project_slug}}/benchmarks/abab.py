"""One entry point's real training, with each library's minimal loop (benchmarks/library_loops.py:
torch's bare optimizer step for every entry point, and for train_accelerate Accelerate's own
accumulate() loop too, each on a copy of the model of its own and the same micro-batches) run
between each two of its steps: A, B, A, B in one process, each timed in CPU time
(time.process_time: what the process computed, not what the machine's other load made it wait),
so that a 2 % difference is resolvable on a shared machine.

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

import torch

from {{ cookiecutter.project_slug }} import session as session_module
from {{ cookiecutter.project_slug }}.cli import run_cli

from .library_loops import AccelerateLoop, TorchLoop

BASELINES = {"pytorch": {"torch": TorchLoop}, "accelerate": {"torch": TorchLoop, "accelerate": AccelerateLoop},
             "trainer": {"torch": TorchLoop}}


class Interleaver:
    """Keeps the clocks: the entry's CPU time per step, and each baseline's on the same window."""

    def __init__(self, entry: str):
        self.loop_types = BASELINES[entry]
        self.entry_s: list[float] = []
        self.baseline_s: dict[str, list[float]] = {name: [] for name in self.loop_types}
        self.handed_over = None  # process_time when the entry got its last window
        self.previous = None  # that window (kept across epochs: the Trainer asks for a new loader each)
        self.loops = None

    def hand_over(self, session, window: list[dict], loading_s: float) -> None:
        """The entry asks for `window` (loaded in `loading_s`): charge it its previous step, run the
        baselines on the previous window, and start the entry's clock again."""
        if self.previous is not None:
            self.entry_s.append(time.process_time() - self.handed_over - loading_s)
            if self.loops is None:
                with torch.random.fork_rng():  # building the copies leaves the entry's random state as it was
                    self.loops = {name: loop(session) for name, loop in self.loop_types.items()}
            for name, loop in self.loops.items():
                self.baseline_s[name].append(loop(self.previous))
        self.previous, self.handed_over = window, time.process_time()


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
    clock = Interleaver(entry)
    (interleave_trainer_loader if entry == "trainer" else interleave_windows)(clock)
    module = __import__(f"{{ cookiecutter.project_slug }}.train_{entry}", fromlist=["train"])
    try:
        run_cli(module.train)
    finally:
        out.write_text(json.dumps({"entry_s": clock.entry_s, **clock.baseline_s}))


if __name__ == "__main__":
    main()
