"""Prepare the data of a config once, before any training job needs it (on a CPU node, say), into
data_cache_dir; it takes the training flags. A data error is one line and exit code 2.

    python -m {{ cookiecutter.project_slug }}.prepare_data --config configs/train.yaml --dataset data/my_corpus
"""

from .cli import run_cli
from .config import TrainConfig
from .model import load_tokenizer
from .prepare import prepare


def prepare_data(cfg: TrainConfig) -> None:
    prepared = prepare(cfg, load_tokenizer(cfg))
    data = prepared.data
    print(f"ready: {len(data['train']):,} training and {len(data['validation']):,} validation "
          f"{'blocks' if cfg.packing else 'examples'} in {prepared.folder}")


if __name__ == "__main__":
    run_cli(prepare_data)
