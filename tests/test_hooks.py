"""The hooks: every bad answer is refused with one clear line and nothing left on disk; a
project name full of quotes and shell syntax is accepted and quoted safely everywhere; the closing
message names where the project is."""

import json
import os
import py_compile
import subprocess
import sys
import tomllib

import pytest
import yaml
from conftest import TEMPLATE, bake_cli, project_files

BAD_ANSWERS = [
    ({"project_slug": "my-project"}, "project_slug 'my-project' is not a Python identifier"),
    ({"project_slug": "2fast"}, "project_slug '2fast' is not a Python identifier"),
    ({"project_slug": "class"}, "project_slug 'class' is a Python keyword"),
    ({"project_slug": "lambda"}, "project_slug 'lambda' is a Python keyword"),
    ({"project_slug": "torch"}, "project_slug 'torch' would shadow the module or folder of that name"),
    *(({"project_slug": name}, f"project_slug '{name}' would shadow the module or folder of that name")
      for name in ("random", "logging", "tqdm", "pyarrow", "benchmarks")),
    ({"project_slug": "x; rm -rf ~"}, "is not a Python identifier"),
    ({"project_slug": "caf\u00e9"}, "is not a Python identifier"),
    ({"micro_batch_size": "0"}, "micro_batch_size must be a positive whole number, got '0'"),
    ({"micro_batch_size": "-4"}, "micro_batch_size must be a positive whole number, got '-4'"),
    ({"global_batch_size": "6.5"}, "global_batch_size must be a positive whole number, got '6.5'"),
    ({"num_nodes": "two"}, "num_nodes must be a positive whole number, got 'two'"),
    ({"gpus_per_node": ""}, "gpus_per_node must be a positive whole number, got ''"),
    ({"cpus_per_gpu": "0"}, "cpus_per_gpu must be a positive whole number, got '0'"),
    ({"cpus_per_gpu": "8 cores"}, "cpus_per_gpu must be a positive whole number, got '8 cores'"),
    ({"global_batch_size": "48"},
     "global_batch_size 48 is not divisible by micro_batch_size 8 x num_nodes 1 x gpus_per_node 4 = 32"),
    ({"num_nodes": "3", "global_batch_size": "64"}, "is not divisible by micro_batch_size 8 x num_nodes 3"),
    # valid for the cluster, not for the 2 CPU processes of `make train` and the project's tests
    ({"gpus_per_node": "3", "global_batch_size": "24"},
     "global_batch_size 24 is not divisible by micro_batch_size 8 x 2, the CPU processes of `make train` and of the "
     "project's own tests = 16; use a micro_batch_size of 4"),
    ({"gpus_per_node": "1", "global_batch_size": "8"}, "= 16; use a micro_batch_size of 4"),
    ({"gpus_per_node": "3", "micro_batch_size": "3", "global_batch_size": "9"},
     "= 6; use a global_batch_size that is a multiple of 6"),
    ({"slurm_partition": "gpu; rm -rf /"}, "slurm_partition 'gpu; rm -rf /' is not a plain name"),
    ({"slurm_partition": ""}, "slurm_partition '' is not a plain name"),
    ({"slurm_account": "$(whoami)"}, "slurm_account '$(whoami)' is not a plain name"),
    ({"slurm_time": "forever"}, "slurm_time 'forever' is not a SLURM time"),
    ({"slurm_time": "4h"}, "slurm_time '4h' is not a SLURM time"),
    ({"wandb_project": "my project"}, "wandb_project 'my project' is not a plain name"),
    ({"wandb_project": "`id`"}, "wandb_project '`id`' is not a plain name"),
    ({"wandb_entity": "team/x"}, "wandb_entity 'team/x' is not a plain name"),
    ({"launchers": "k8s"}, "launchers 'k8s' names 'k8s', which is not a launcher; use 'all' or a comma-separated list "
                           "of slurm, kubernetes, skypilot"),
    ({"launchers": "slurm,,"}, "launchers 'slurm,,' names '', which is not a launcher"),
    ({"launchers": ""}, "launchers '' names '', which is not a launcher"),
    ({"launchers": "slurm;kubernetes"}, "names 'slurm;kubernetes', which is not a launcher"),
    ({"launchers": "kubernetes, sky"}, "names 'sky', which is not a launcher"),
    ({"extras": "lora"}, "extras 'lora' names 'lora', which is not an extra; use 'none', 'all' or a comma-separated "
                         "list of fsdp, auto_batch, batch_schedule, doctor, safe_checkpoints, benchmarks, peft"),
    ({"extras": "fsdp,,"}, "extras 'fsdp,,' names '', which is not an extra"),
    ({"extras": ""}, "extras '' names '', which is not an extra"),
    ({"extras": "none,fsdp"}, "extras 'none,fsdp' mixes none with extras"),
    ({"extras": "fsdp;doctor"}, "names 'fsdp;doctor', which is not an extra"),
    ({"container_image": "My Image"}, "container_image 'My Image' is not an image reference"),
    ({"container_image": "img:$(id)"}, "container_image 'img:$(id)' is not an image reference"),
    ({"project_slug": "a" * 51}, f"project_slug '{'a' * 51}' gives the Kubernetes name '{'a' * 51}', which is not "
                                 "1-50 lowercase letters, digits and '-'"),
]


@pytest.mark.parametrize("answers,message", BAD_ANSWERS, ids=[str(a) for a, _ in BAD_ANSWERS])
def test_bad_answer_is_refused(tmp_path, answers, message):
    proc = bake_cli(tmp_path, **answers)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_unknown_choice_is_refused_by_cookiecutter(tmp_path):
    proc = bake_cli(tmp_path, task="translation")
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("answers", [
    {"slurm_time": "1-00:00:00", "slurm_account": "", "wandb_entity": ""},
    {"slurm_time": "90", "slurm_account": "my_lab", "wandb_entity": "my-team", "slurm_partition": "a100"},
    {"micro_batch_size": "3", "global_batch_size": "96", "num_nodes": "4", "gpus_per_node": "8"},
    {"micro_batch_size": "4", "global_batch_size": "24", "gpus_per_node": "3"},
    {"launchers": "slurm", "container_image": "My Image"},  # the image only matters to Kubernetes
    {"launchers": "Kubernetes, SLURM", "container_image": "ghcr.io/my-team/acme-train:1.0"},
    {"project_slug": "a" * 51, "launchers": "slurm,skypilot"},  # no Kubernetes name needed
    {"project_slug": "Acme_Train_", "launchers": "kubernetes"},  # named acme-train there
])
def test_good_answers_are_accepted(tmp_path, answers):
    proc = bake_cli(tmp_path, **answers)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("elsewhere", [False, True], ids=["here", "elsewhere"])
def test_the_closing_message_names_where_the_project_is(tmp_path, elsewhere):
    """`cd` into the project as the message says, from the shell's folder: ./<slug> where it was
    made there, else its whole path (-o put it elsewhere)."""
    here, out = tmp_path / "here", tmp_path / ("there" if elsewhere else "here")
    for folder in {here, out}:
        folder.mkdir()
    proc = subprocess.run([sys.executable, "-m", "cookiecutter", str(TEMPLATE), "--no-input", "-o", str(out),
                           "project_slug=acme_train"], cwd=here, env={**os.environ, "PWD": str(here)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = str(out / "acme_train") if elsewhere else "./acme_train"
    assert f"in {shown}. Next:\n  cd {shown}\n" in proc.stdout, proc.stdout
    assert (here / shown).is_dir()


HOSTILE_NAME = 'Evil "Proj" \'x\' $(touch PWNED1) `touch PWNED2` \\ """ #'


def test_hostile_project_name_is_quoted_safely(tmp_path):
    proc = bake_cli(tmp_path, project_name=HOSTILE_NAME, project_slug="evil_proj")
    assert proc.returncode == 0, proc.stderr
    project = tmp_path / "evil_proj"
    for path in project.rglob("*.py"):
        py_compile.compile(str(path), doraise=True)
    for path in project.rglob("*.yaml"):
        list(yaml.safe_load_all(path.read_text()))  # every document (k8s/ files hold two)
    for path in project.rglob("*.json"):
        json.loads(path.read_text())
    tomllib.loads((project / "pyproject.toml").read_text())
    for path in list(project.rglob("*.sh")) + list(project.rglob("*.sbatch")):
        subprocess.run(["bash", "-n", str(path)], check=True)
        subprocess.run(["bash", str(path)], cwd=project, env={"DRY_RUN": "1", "NPROC_PER_NODE": "1",
                       "MASTER_PORT": "29500", "PATH": "/usr/bin:/bin"}, capture_output=True, timeout=60)
    init = project / "src" / "evil_proj" / "__init__.py"
    namespace: dict = {"__file__": str(init)}
    exec(init.read_text(), namespace)
    assert namespace["PROJECT_NAME"] == HOSTILE_NAME
    assert json.loads((project / ".cookiecutter.json").read_text())["project_name"] == HOSTILE_NAME
    assert HOSTILE_NAME in (project / "README.md").read_text()
    assert not list(tmp_path.rglob("PWNED*"))  # the bake ran in tmp_path, the scripts in project


@pytest.mark.parametrize("name,slug", [("Acme Vision-Train 2", "acme_vision_train_2"),
                                       ("3D Vision", "project_3d_vision"), ("!!!", "my_project")])
def test_default_slug_comes_from_the_name(tmp_path, name, slug):
    proc = bake_cli(tmp_path, project_name=name)
    assert proc.returncode == 0, proc.stderr
    assert f"src/{slug}/config.py" in project_files(tmp_path / slug)
