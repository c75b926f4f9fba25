"""Loading and collating: the window sampler's micro-batches read from the prepared data
(prepare.py) and padded on the right, the same way for every entry point and world size; the
evaluation loader's shard of every rank. Which examples each step takes: windows.py.
"""

import math

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = -100
TARGETS = "targets"  # the prepared training column of each example's targets (example_sizes)
ASSISTANT = "assistant_masks"  # chat: 1 on each token of an assistant turn, as apply_chat_template marks it


class _Marked(Dataset):
    """Reads `(index, real)` keys, each example marked real or filler: a micro-batch in one gather from the dataset."""

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


def labels_for(example: dict, task: str) -> torch.Tensor:
    """THE labelling rule: one example's labels, what its loss counts (-100: not counted). The Collator labels every
    micro-batch with it and preparation counts each example's targets with it (each step's divisor), so change what the
    loss counts here only; its source keys the data cache and data_fingerprint (a resume after a change is refused).
    causal_lm: the tokens (summed_loss shifts them: token t is position t-1's target); a prompt mask is
    `labels[:k] = IGNORE_INDEX` on this copy; chat: the assistant's tokens only; classification: the example's label."""
    if task == "sequence_classification":
        return torch.tensor(example["label"])
    labels = torch.tensor(example["input_ids"], dtype=torch.long)
    if task == "chat":
        labels[torch.tensor(example[ASSISTANT]) == 0] = IGNORE_INDEX
    return labels


class Collator:
    """Pads input_ids on the right with the pad token; labels by labels_for, -100 on padding and on a
    filler example. attention_mask only for classification: causal attention never lets a real token
    see the padding on its right, and without a mask SDPA gets `is_causal=True` (docs/performance.md)."""

    def __init__(self, tokenizer, task: str):
        self.pad_token_id, self.task = tokenizer.pad_token_id, task

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, f in enumerate(features):
            input_ids[row, :len(f["input_ids"])] = torch.as_tensor(f["input_ids"])
            attention_mask[row, :len(f["input_ids"])] = 1
        filler = ~torch.tensor([f.get("real", True) for f in features])
        if self.task != "sequence_classification":
            labels = torch.full_like(input_ids, IGNORE_INDEX)
            for row, f in enumerate(features):
                labels[row, :len(f["input_ids"])] = labels_for(f, self.task)
            labels[filler] = IGNORE_INDEX
            return {"input_ids": input_ids, "labels": labels}
        labels = torch.stack([labels_for(f, self.task) for f in features]).long()
        labels[filler] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class WindowLoader(DataLoader):
    """DataLoader over a WindowSampler; `set_epoch` reaches the sampler (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def loading(workers: int, pin_memory: bool) -> dict:
    """DataLoader arguments: `workers` collate ahead (kept between epochs), in pinned memory for non-blocking copies."""
    return {"num_workers": workers, "persistent_workers": workers > 0, "pin_memory": pin_memory}


def train_dataloader(train_set, sampler, collator: Collator, **loading_kwargs) -> WindowLoader:
    return WindowLoader(_Marked(train_set), batch_sampler=sampler, collate_fn=collator, **loading_kwargs)


def eval_dataloader(eval_set, rank: int, world_size: int, batch_size: int,
                    collator: Collator, **loading_kwargs) -> DataLoader:
    """This rank's strided share of the evaluation set (every example once overall), in as many batches as rank 0's:
    a rank with fewer runs filler batches, since a sharded forward (ZeRO-3, FSDP) is a collective all ranks join."""
    shard = list(range(rank, len(eval_set), world_size))
    batches = [[(i, True) for i in shard[j:j + batch_size]] for j in range(0, len(shard), batch_size)]
    per_rank = math.ceil(math.ceil(len(eval_set) / world_size) / batch_size)
    batches += [[(0, False)]] * (per_rank - len(batches))
    return DataLoader(_Marked(eval_set), batch_sampler=batches, collate_fn=collator, **loading_kwargs)


def example_sizes(dataset) -> tuple[np.ndarray, np.ndarray]:
    """Each example's tokens (a packed block: max_seq_len) and targets (its labels_for counted as the
    loss counts them, once, when it was prepared), from the prepared columns: no pass over the tokens."""
    return pc.list_value_length(dataset.data.column("input_ids")).to_numpy(), dataset.data.column(TARGETS).to_numpy()
