"""`make config`: write the template's `configs/train.yaml` from the one home of every default,
`TrainConfig` in the project's config.py. Bakes the template (default answers) into a temporary
folder, renders the YAML there (`python -m <slug>.config`), and puts the answers' Jinja back into
the lines the answers decide. Each extra's keys (a bake with every extra) go inside a Jinja block
that keeps them where the extra is baked. The baked project's tests check the file against the dataclass, so a
default changed in one place only fails the suite until this has been run."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
TARGET = TEMPLATE / "{{cookiecutter.project_slug}}" / "configs" / "train.yaml"
SLUG = "gacc_train"  # the default answer's slug
ANSWER_KEYS = {"task": '"{{ cookiecutter.task }}"', "micro_batch_size": "{{ cookiecutter.micro_batch_size }}",
               "global_batch_size": "{{ cookiecutter.global_batch_size }}",
               "wandb_project": '"{{ cookiecutter.wandb_project }}"',
               "wandb_entity": '"{{ cookiecutter.wandb_entity }}"'}


def main() -> int:
    with tempfile.TemporaryDirectory() as out:
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=out, extra_context={"extras": "all"}))
        rendered = subprocess.run([sys.executable, "-m", f"{SLUG}.config"], cwd=project, capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": "src"}).stdout
    for key, jinja in ANSWER_KEYS.items():
        rendered, count = re.subn(rf"^{key}: .*$", f"{key}: {jinja}", rendered, flags=re.MULTILINE)
        assert count == 1, key
    core, *blocks = re.split(r"\n(?=\n# == Extra \w+:)", rendered.rstrip("\n"))
    for block in blocks:
        extra = re.match(r"\n# == Extra (\w+):", block)[1]
        core += f"\n{{%- if '{extra}' in cookiecutter.__extras.split(',') %}}\n{block}\n{{%- endif %}}"
    TARGET.write_text((core + "\n").replace(SLUG, "{{ cookiecutter.project_slug }}"))
    print(f"wrote {TARGET.relative_to(TEMPLATE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
