"""Validate the rendered cookiecutter answers before any file is generated.

A bad answer ends generation with exit code 1 and one line on stderr that says what is wrong and
what would be right; cookiecutter then removes the half-made output directory. Standard library
only. Answers are read through `tojson`, so no answer can break this file's syntax.
"""

import json
import keyword
import re
import sys

ANSWERS = json.loads(
    r"""
{{ cookiecutter | tojson }}
"""
)

# Packages the generated project imports: a slug equal to one of them would shadow it.
# A slug that is the name of a module the project imports (the standard library, a dependency or
# one they pull in) or of a folder the project has would shadow it: the project could not import.
SHADOWED = set(sys.stdlib_module_names) | {
    "torch", "transformers", "accelerate", "datasets", "deepspeed", "wandb", "yaml", "tokenizers", "safetensors",
    "numpy", "pyarrow", "tqdm", "huggingface_hub", "filelock", "fsspec", "packaging", "psutil", "regex",
    "requests", "pandas", "dill", "xxhash", "multiprocess", "jinja2", "sympy", "networkx", "matplotlib", "pytest",
    "ruff", "pydantic", "hjson", "ninja", "einops", "msgpack", "cookiecutter", "cruft",
    "tests", "test", "src", "configs", "scripts", "benchmarks", "docs"}
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# SLURM's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
POSITIVE_INT = re.compile(r"[1-9][0-9]{0,6}")
LOCAL_PROCESSES = 2  # `make train` and the tests on a machine without GPUs
LAUNCHERS = ("slurm", "kubernetes", "skypilot")
# The extras: training features beside the core, each in files of its own (docs/extending.md).
EXTRAS = ("fsdp", "auto_batch", "batch_schedule", "doctor", "safe_checkpoints", "benchmarks", "peft", "sweeps")
# A Kubernetes object name (DNS-1123 label) short enough for the JobSet's pod names, <name>-node-0-<i>.
K8S_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,48}[a-z0-9])?")
# A container image reference: [registry[:port]/]path[:tag][@digest].
IMAGE = re.compile(r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
                   r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?")


def check_slug(slug: str) -> str | None:
    if not slug.isidentifier() or not slug.isascii():
        return (f"project_slug {slug!r} is not a Python identifier; use lowercase letters, digits and "
                "underscores, e.g. 'acme_train'")
    if keyword.iskeyword(slug):
        return f"project_slug {slug!r} is a Python keyword; choose another name, e.g. '{slug}_train'"
    if slug in SHADOWED:
        return (f"project_slug {slug!r} would shadow the module or folder of that name, which the project "
                f"imports or has; choose another, e.g. '{slug}_train'")
    return None


def check_numbers(answers: dict) -> str | None:
    numbers = {}
    for key in ("micro_batch_size", "global_batch_size", "num_nodes", "gpus_per_node", "cpus_per_gpu"):
        value = str(answers[key]).strip()
        if not POSITIVE_INT.fullmatch(value):
            return f"{key} must be a positive whole number, got {answers[key]!r}, e.g. '8'"
        numbers[key] = int(value)
    per_step = numbers["micro_batch_size"] * numbers["num_nodes"] * numbers["gpus_per_node"]
    if numbers["global_batch_size"] % per_step:
        return (
            f"global_batch_size {numbers['global_batch_size']} is not divisible by micro_batch_size "
            f"{numbers['micro_batch_size']} x num_nodes {numbers['num_nodes']} x gpus_per_node "
            f"{numbers['gpus_per_node']} = {per_step}; use a multiple of {per_step}, e.g. {per_step * 2}"
        )
    local = numbers["micro_batch_size"] * LOCAL_PROCESSES
    if numbers["global_batch_size"] % local:
        fits = [m for m in range(1, numbers["micro_batch_size"])
                if numbers["global_batch_size"] % (m * LOCAL_PROCESSES) == 0
                and numbers["global_batch_size"] % (m * numbers["num_nodes"] * numbers["gpus_per_node"]) == 0]
        advice = f"a micro_batch_size of {fits[-1]}" if fits else f"a global_batch_size that is a multiple of {local}"
        return (
            f"global_batch_size {numbers['global_batch_size']} is not divisible by micro_batch_size "
            f"{numbers['micro_batch_size']} x {LOCAL_PROCESSES}, the CPU processes of `make train` and of the "
            f"project's own tests = {local}; use {advice}"
        )
    return None


def check_names(answers: dict) -> str | None:
    rules = (
        ("slurm_partition", False, "a partition name such as 'gpu'"),
        ("slurm_account", True, "an account name such as 'my_lab', or empty for none"),
        ("wandb_project", False, "a project name such as 'acme_train'"),
        ("wandb_entity", True, "a team or user name such as 'my-team', or empty for your default"),
    )
    for key, may_be_empty, example in rules:
        value = answers[key]
        if value == "" and may_be_empty:
            continue
        if not PLAIN_NAME.fullmatch(value):
            return f"{key} {value!r} is not a plain name (letters, digits, '_', '.', '-'); use {example}"
    if not SLURM_TIME.fullmatch(answers["slurm_time"]):
        return (
            f"slurm_time {answers['slurm_time']!r} is not a SLURM time; use H:M:S or D-H:M:S, "
            "e.g. '04:00:00' or '1-00:00:00'"
        )
    return None


def check_launchers(answers: dict) -> str | None:
    """`launchers`: all, or a comma-separated list of LAUNCHERS in any case, spaces around the names
    allowed (cookiecutter.json's `__launchers` holds the normalised list that the files use)."""
    names = [name.strip().lower() for name in answers["launchers"].split(",")]
    unknown = [name for name in names if name not in ("all", *LAUNCHERS)]
    if unknown:
        return (f"launchers {answers['launchers']!r} names {unknown[0]!r}, which is not a launcher; use 'all' or a "
                f"comma-separated list of {', '.join(LAUNCHERS)}, e.g. 'slurm,kubernetes'")
    if "kubernetes" in answers["__launchers"]:
        if not K8S_NAME.fullmatch(answers["__k8s_name"]):
            return (f"project_slug {answers['project_slug']!r} gives the Kubernetes name {answers['__k8s_name']!r}, "
                    "which is not 1-50 lowercase letters, digits and '-'; choose a shorter slug or leave kubernetes "
                    "out of launchers")
        if not IMAGE.fullmatch(answers["container_image"]):
            return (f"container_image {answers['container_image']!r} is not an image reference; use "
                    "[registry/]name[:tag], e.g. 'ghcr.io/my-team/acme-train:1.0'")
    return None


def check_extras(answers: dict) -> str | None:
    """`extras`: none, all, or a comma-separated list of EXTRAS in any case, spaces around the names
    allowed (cookiecutter.json's `__extras` holds the normalised list that the files use)."""
    names = [name.strip().lower() for name in answers["extras"].split(",")]
    unknown = [name for name in names if name not in ("none", "all", *EXTRAS)]
    if unknown or ("none" in names and len(names) > 1):
        what = f"names {unknown[0]!r}, which is not an extra" if unknown else "mixes none with extras"
        return (f"extras {answers['extras']!r} {what}; use 'none', 'all' or a comma-separated list of "
                f"{', '.join(EXTRAS)}, e.g. 'fsdp,doctor'")
    return None


def main() -> int:
    for check in (lambda a: check_slug(a["project_slug"]), check_numbers, check_names, check_launchers,
                  check_extras):
        problem = check(ANSWERS)
        if problem:
            print(f"ERROR: {problem}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
