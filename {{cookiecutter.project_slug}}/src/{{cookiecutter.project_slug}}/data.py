"""Data: order and collate, the same way for every entry point and world size (prepare.py reads
and tokenises).

Data order (independent of the world size): epoch e draws one permutation of the training set
from (seed, e). Optimizer step s of the epoch consumes the examples at positions
[s*G, (s+1)*G) of that permutation (G = global batch); rank r takes every world_size-th of them
and cuts its share into micro-batches. The last window of an epoch takes the remainder: no
example is duplicated or dropped. When the remainder leaves a rank with an empty micro-batch,
that rank runs a *filler* micro-batch whose labels are all masked, so every rank takes the same
number of micro-steps (DDP needs that) and the filler adds exactly zero to the gradient.
"""

import math

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

from .batch import BatchPlan

IGNORE_INDEX = -100


class WindowSampler(Sampler):
    """Yields this rank's micro-batches, one accumulation window (optimizer step) after another.

    Each micro-batch is a list of `(index, real)` pairs; `real` is False only in filler
    micro-batches (see the module docstring).
    """

    def __init__(self, num_examples: int, plan: BatchPlan, rank: int, seed: int):
        self.num_examples = num_examples
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start_step = 0

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.plan.global_batch_size)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's permutation and the optimizer step to start from (for resuming)."""
        self.epoch = epoch
        self.start_step = start_step

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def micro_steps(self, step: int) -> int:
        """Micro-batches in window `step` on every rank (grad_accum_steps, fewer at an epoch's end)."""
        size = min(self.plan.global_batch_size, self.num_examples - step * self.plan.global_batch_size)
        share = math.ceil(size / self.plan.world_size)
        return math.ceil(share / self.plan.micro_batch_size)

    def window(self, epoch: int, step: int) -> list[list[tuple[int, bool]]]:
        g = self.plan.global_batch_size
        order = self.permutation(epoch)[step * g:(step + 1) * g].tolist()
        share = order[self.rank::self.plan.world_size]
        b = self.plan.micro_batch_size
        batches = []
        for m in range(self.micro_steps(step)):
            part = share[m * b:(m + 1) * b]
            batches.append([(i, True) for i in part] or [(order[0], False)])
        return batches

    def __iter__(self):
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.window(self.epoch, step)

    def __len__(self) -> int:
        return sum(self.micro_steps(s) for s in range(self.start_step, self.steps_per_epoch))


class _Marked(Dataset):
    """Looks up `(index, real)` pairs and marks each example real or filler."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, bool]) -> dict:
        index, real = key
        return {**self.dataset[index], "real": real}


class Collator:
    """Pads on the right and builds labels: padding (and filler examples) become -100."""

    def __init__(self, tokenizer, task: str):
        if task == "causal_lm":
            self.inner = DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="pt")
        else:
            self.inner = DataCollatorWithPadding(tokenizer, padding="longest", return_tensors="pt")

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        real = torch.tensor([f.get("real", True) for f in features])
        batch = dict(self.inner([{k: v for k, v in f.items() if k != "real"} for f in features]))
        batch["labels"][~real] = IGNORE_INDEX
        return batch


class WindowLoader(DataLoader):
    """DataLoader over a WindowSampler; `set_epoch` reaches the sampler (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def train_dataloader(train_set, sampler: WindowSampler, collator: Collator) -> WindowLoader:
    return WindowLoader(_Marked(train_set), batch_sampler=sampler, collate_fn=collator)


def eval_dataloader(eval_set, rank: int, world_size: int, batch_size: int,
                    collator: Collator) -> DataLoader:
    """This rank's strided share of the evaluation set: every example exactly once overall.

    Every rank runs the same number of batches (that of rank 0, which has the largest share): a
    rank with fewer runs a filler batch (no real targets) for each one it lacks, since a sharded
    model's forward (ZeRO-3, FSDP) is a collective that all ranks must join."""
    shard = list(range(rank, len(eval_set), world_size))
    batches = [[(i, True) for i in shard[j:j + batch_size]] for j in range(0, len(shard), batch_size)]
    per_rank = math.ceil(math.ceil(len(eval_set) / world_size) / batch_size)
    batches += [[(0, False)]] * (per_rank - len(batches))
    return DataLoader(_Marked(eval_set), batch_sampler=batches, collate_fn=collator)
