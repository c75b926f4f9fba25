"""Data order and collation: deterministic, independent of the world size, nothing duplicated
or dropped, padding on the right and masked out of the loss."""

import pytest

from {{ cookiecutter.project_slug }}.batch import plan_batches
from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.data import IGNORE_INDEX, Collator, WindowSampler, eval_dataloader
from {{ cookiecutter.project_slug }}.model import count_targets, load_tokenizer
from {{ cookiecutter.project_slug }}.prepare import find_source, prepare

from conftest import ROOT

CONFIG = str(ROOT / "configs" / "train.yaml")


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


@pytest.fixture(scope="module")
def lm():
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm"])
    tokenizer = load_tokenizer(cfg)
    return cfg, tokenizer, prepare(cfg, tokenizer).data


def test_collator_pads_right_and_masks_padding_and_fillers(lm):
    cfg, tokenizer, data = lm
    rows = [{**data["train"][i], "real": True} for i in range(6)] + [{**data["train"][6], "real": False}]
    batch = Collator(tokenizer, "causal_lm")(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (7, max(lengths))
    for row, n in enumerate(lengths[:6]):
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert (batch["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["labels"][row, :n].tolist() == batch["input_ids"][row, :n].tolist()
    assert (batch["labels"][6] == IGNORE_INDEX).all()  # filler: no targets at all
    assert count_targets(batch["labels"], "causal_lm") == sum(n - 1 for n in lengths[:6])


@pytest.mark.parametrize("world_size,batch_size", [(3, 8), (3, 1), (8, 1), (2, 7)])
def test_eval_shards_count_every_example_once(lm, world_size, batch_size):
    """Each example once over all ranks, and the same number of batches on every rank (ZeRO-3 and
    FSDP forwards are collectives): a rank with a smaller share runs filler batches."""
    cfg, tokenizer, data = lm
    collator = Collator(tokenizer, "causal_lm")
    total, batches = 0, []
    for rank in range(world_size):
        loader = list(eval_dataloader(data["validation"], rank, world_size, batch_size, collator))
        batches.append(len(loader))
        total += sum(int((batch["labels"][:, 0] != IGNORE_INDEX).sum()) for batch in loader)
    assert total == len(data["validation"])
    assert len(set(batches)) == 1


def test_classification_labels(tmp_path):
    cfg = load_config(["--config", CONFIG, "--task", "sequence_classification"])
    tokenizer = load_tokenizer(cfg)
    data = prepare(cfg, tokenizer).data
    rows = [{**data["train"][i], "real": i != 2} for i in range(4)]
    batch = Collator(tokenizer, "sequence_classification")(rows)
    assert batch["labels"].tolist() == [r["label"] if r["real"] else IGNORE_INDEX for r in rows]
    assert set(data["train"]["label"]) == {0, 1}


def test_dataset_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder of train/validation files"):
        find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path / "none")]))
    (tmp_path / "train.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(ConfigError, match="has no validation split"):
        find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path)]))
    (tmp_path / "validation.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(ConfigError, match=r"lacks column\(s\) label"):
        find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path),
                                      "--task", "sequence_classification"]))
