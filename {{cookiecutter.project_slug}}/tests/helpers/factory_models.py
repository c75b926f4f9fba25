"""Models of a team's own for test_model_factory.py, built through `model_factory` as
`helpers.factory_models:<function>` (the tests put tests/ on PYTHONPATH): plain torch modules, no
Hugging Face class, and the mistakes a factory can make.
"""

import torch
from torch import nn

NOT_CALLABLE = "a string, not a function"


class TinyGRU(nn.Module):
    """Embedding, a GRU and a head tied to the embedding (causal_lm: logits for each token), or a
    head of num_labels classes on the last real token's state (sequence_classification)."""

    def __init__(self, vocab_size: int, num_labels: int | None, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_labels or vocab_size, bias=False)
        if num_labels is None:
            self.head.weight = self.embed.weight
        self.classify = num_labels is not None

    def forward(self, input_ids, attention_mask=None):
        states, _ = self.gru(self.embed(input_ids))
        if not self.classify:
            return self.head(states)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        last = mask.sum(dim=1).clamp(min=1) - 1
        return self.head(states[torch.arange(len(input_ids), device=input_ids.device), last])


def gru(vocab_size, num_labels, cfg):
    return TinyGRU(vocab_size, num_labels)


def unused_pooler(vocab_size, num_labels, cfg):
    """TinyGRU with a pooler its forward never uses, as a model built for another task keeps one."""
    model = TinyGRU(vocab_size, num_labels)
    model.pooler = nn.Linear(32, 32)
    return model


def positional(vocab_size):
    return TinyGRU(vocab_size, None)


def not_a_module(vocab_size, num_labels, cfg):
    return {"vocab_size": vocab_size}


def wrong_vocab(vocab_size, num_labels, cfg):
    return TinyGRU(vocab_size + 1, None if num_labels is None else num_labels + 1)
