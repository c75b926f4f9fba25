"""Data: order and collate, the same way for every entry point and world size (prepare.py reads
and tokenises).

Data order (independent of the world size): epoch e draws one permutation of the training set
from (seed, e). Optimizer step s of the epoch consumes the examples at positions
[offset_s, offset_s + G_s) of that permutation: G_s is the step's global batch (the
global_batch_size_schedule's, G throughout without one) and offset_s the sum of the epoch's earlier
steps' (s*G without a schedule); rank r takes every world_size-th of them
and cuts its share into micro-batches. The last window of an epoch takes the remainder: no
example is duplicated or dropped. When the remainder leaves a rank with an empty micro-batch,
that rank runs a *filler* micro-batch whose labels are all masked, so every rank takes the same
number of micro-steps (DDP needs that) and the filler adds exactly zero to the gradient.
Under torch.compile a micro-batch has at least 2 rows (`min_rows`), filled the same way: dynamo
specialises a dimension of size 1, so a remainder of one example would compile a second graph.
"""

import bisect
import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .batch import BatchPlan

IGNORE_INDEX = -100


class WindowSampler(Sampler):
    """Yields this rank's micro-batches, one accumulation window (optimizer step) after another.

    Each micro-batch is a list of `(index, real)` pairs; `real` is False only in filler
    micro-batches (see the module docstring). Steps are counted over the run (the schedule's
    global batch follows them) and, within an epoch, from its first step.
    """

    def __init__(self, num_examples: int, plan: BatchPlan, rank: int, seed: int, min_rows: int = 1):
        self.num_examples = num_examples
        self.min_rows = min_rows  # filler rows make up the difference (at most micro_batch_size)
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start_step = 0
        self._drawn: tuple[int, np.ndarray] | None = None  # (epoch, its permutation): drawn once per epoch
        self._firsts = [0]  # the run's step at which each epoch begins (and the one after the last known)
        self._sizes: tuple[int, tuple[list[int], list[int]]] | None = None  # (epoch, _epoch(epoch))

    def epoch_sizes(self, epoch: int) -> list[int]:
        """The global batch of each optimizer step of `epoch`: the schedule's, the last one the remainder."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """(the global batch of each step of `epoch`, where each begins in its permutation)."""
        if self._sizes is None or self._sizes[0] != epoch:
            sizes = [size for size, count in self._runs(self.first_step(epoch)) for _ in range(count)]
            self._sizes = epoch, (sizes, list(itertools.accumulate(sizes[:-1], initial=0)))
        return self._sizes[1]

    def _runs(self, first_step: int) -> Iterator[tuple[int, int]]:
        """The epoch that begins at the run's step `first_step`, as (global batch, steps) runs: the
        schedule's sizes, then the remainder (one step) when the examples do not divide."""
        offset, step = 0, first_step
        while offset < self.num_examples:
            size = self.plan.global_batch_at(step)
            full = (self.num_examples - offset) // size
            if not full:
                yield self.num_examples - offset, 1
                return
            later = [start - step for start, _ in self.plan.schedule if start > step]
            count = min([full, *later[:1]])
            yield size, count
            offset, step = offset + size * count, step + count

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, its steps done) after `step` optimizer steps of the run."""
        while self._firsts[-1] <= step:
            self._firsts.append(self._firsts[-1] + sum(count for _, count in self._runs(self._firsts[-1])))
        epoch = bisect.bisect_right(self._firsts, step) - 1
        return epoch, step - self._firsts[epoch]

    def first_step(self, epoch: int) -> int:
        """The run's step at which `epoch` begins (the steps of the epochs before it)."""
        while len(self._firsts) <= epoch:
            self.epoch_of(self._firsts[-1])
        return self._firsts[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the current epoch (of every epoch without a schedule)."""
        return len(self.epoch_sizes(self.epoch))

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's permutation and the optimizer step to start from (for resuming)."""
        self.epoch = epoch
        self.start_step = start_step

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of the training set, drawn once per epoch (a step then only slices it)."""
        if self._drawn is None or self._drawn[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._drawn = epoch, order.astype(np.int32) if self.num_examples < 2**31 else order
        return self._drawn[1]

    def micro_steps(self, step: int, epoch: int | None = None) -> int:
        """Micro-batches in window `step` of `epoch` (the current one when None) on every rank (the
        step's grad_accum_steps, fewer at an epoch's end)."""
        share = math.ceil(self.epoch_sizes(self.epoch if epoch is None else epoch)[step] / self.plan.world_size)
        return math.ceil(share / self.plan.micro_batch_size)

    def examples(self, step: int) -> np.ndarray:
        """The examples of the run's optimizer step after `step` steps done, on all ranks."""
        return self._examples(*self.epoch_of(step))

    def _examples(self, epoch: int, step: int) -> np.ndarray:
        sizes, offsets = self._epoch(epoch)
        return self.permutation(epoch)[offsets[step]:offsets[step] + sizes[step]]

    def window(self, epoch: int, step: int) -> list[list[tuple[int, bool]]]:
        order = self._examples(epoch, step).tolist()
        share = order[self.rank::self.plan.world_size]
        b = self.plan.micro_batch_size
        rows = min(self.min_rows, b)
        batches = []
        for m in range(self.micro_steps(step, epoch)):
            part = [(i, True) for i in share[m * b:(m + 1) * b]]
            batches.append(part + [(order[0], False)] * max(rows - len(part), 0))
        return batches

    def __iter__(self):
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.window(self.epoch, step)

    def __len__(self) -> int:
        """Micro-batches from start_step to the epoch's end."""
        return sum(self.micro_steps(step) for step in range(self.start_step, self.steps_per_epoch))


class _Marked(Dataset):
    """Looks up `(index, real)` pairs and marks each example real or filler; a micro-batch's
    examples are read from the (memory-mapped) dataset in one gather."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, bool]) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, bool]]) -> list[dict]:
        columns = self.dataset[[index for index, _ in keys]]
        return [{**{name: values[row] for name, values in columns.items()}, "real": real}
                for row, (_, real) in enumerate(keys)]


class Collator:
    """Pads input_ids on the right with the pad token; attention_mask marks the real tokens.
    Labels: for causal_lm the input_ids themselves (summed_loss shifts them), -100 on padding; for
    classification each example's label. A filler example's labels are all -100."""

    def __init__(self, tokenizer, task: str):
        self.pad_token_id, self.task = tokenizer.pad_token_id, task

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, f in enumerate(features):
            input_ids[row, :len(f["input_ids"])] = torch.as_tensor(f["input_ids"])
            attention_mask[row, :len(f["input_ids"])] = 1
        if self.task == "causal_lm":
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        else:
            labels = torch.tensor([f["label"] for f in features], dtype=torch.long)
        labels[~torch.tensor([f.get("real", True) for f in features])] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class WindowLoader(DataLoader):
    """DataLoader over a WindowSampler; `set_epoch` reaches the sampler (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def loading(workers: int, pin_memory: bool) -> dict:
    """DataLoader arguments: `workers` processes collate the next micro-batches while the device
    computes (kept between epochs), into pinned memory for non-blocking copies to a GPU."""
    return {"num_workers": workers, "persistent_workers": workers > 0, "pin_memory": pin_memory}


def train_dataloader(train_set, sampler: WindowSampler, collator: Collator, **loading_kwargs) -> WindowLoader:
    return WindowLoader(_Marked(train_set), batch_sampler=sampler, collate_fn=collator, **loading_kwargs)


def eval_dataloader(eval_set, rank: int, world_size: int, batch_size: int,
                    collator: Collator, **loading_kwargs) -> DataLoader:
    """This rank's strided share of the evaluation set: every example exactly once overall.

    Every rank runs the same number of batches (that of rank 0, which has the largest share): a
    rank with fewer runs a filler batch (no real targets) for each one it lacks, since a sharded
    model's forward (ZeRO-3, FSDP) is a collective that all ranks must join."""
    shard = list(range(rank, len(eval_set), world_size))
    batches = [[(i, True) for i in shard[j:j + batch_size]] for j in range(0, len(shard), batch_size)]
    per_rank = math.ceil(math.ceil(len(eval_set) / world_size) / batch_size)
    batches += [[(0, False)]] * (per_rank - len(batches))
    return DataLoader(_Marked(eval_set), batch_sampler=batches, collate_fn=collator, **loading_kwargs)
