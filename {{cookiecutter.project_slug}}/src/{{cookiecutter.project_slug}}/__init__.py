"""Distributed training with gradient accumulation, three ways.

`train_pytorch` (plain PyTorch DDP), `train_accelerate` (HF Accelerate) and `train_trainer`
(HF Transformers Trainer) share this package's config, batch maths, data, model, tracking and
checkpoint code, and produce the same training on the same seed.
"""

from pathlib import Path

PROJECT_NAME = {{ cookiecutter.project_name | tojson }}
ASSETS = Path(__file__).resolve().parent / "assets"  # the tokenizer and data that ship with the project
