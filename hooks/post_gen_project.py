"""Remove what the user did not choose, record the answers, print the next commands.

Standard library only; answers are read through `tojson` so no answer can break this file.
"""

import json
import os
import shlex
import shutil
from pathlib import Path

ANSWERS = json.loads(
    r"""
{{ cookiecutter | tojson }}
"""
)

SLUG = ANSWERS["project_slug"]
ENTRIES = ("pytorch", "accelerate", "trainer")
# Each extra's own files, removed when it is not baked ({pkg}: src/<slug>); a file that several
# extras share stays while one of them is baked. docs/extending.md lists what each extra adds.
EXTRA_FILES = {
    "fsdp": ["{pkg}/fsdp.py", "{pkg}/sharding.py", "tests/test_fsdp.py"],
    "auto_batch": ["{pkg}/auto_batch.py", "{pkg}/memory.py", "tests/helpers/oom_injection.py",
                   "tests/test_auto_batch.py", "docs/batch.md"],
    "batch_schedule": ["{pkg}/batch_schedule.py", "{pkg}/noise.py", "docs/noise_scale.png",
                       "tests/test_batch_schedule.py", "docs/batch.md"],
    "doctor": ["{pkg}/doctor.py", "{pkg}/hangs.py", "tests/test_doctor.py", "tests/helpers/doctor_faults.py",
               "tests/test_hangs.py", "tests/helpers/collective_mismatch.py"],
    "safe_checkpoints": ["{pkg}/checkpoint_checks.py", "tests/test_safe_checkpoints.py"],
    "benchmarks": ["benchmarks/__main__.py", "benchmarks/abab.py", "benchmarks/checkpointing.py",
                   "benchmarks/communication.py", "benchmarks/data.py", "benchmarks/harness.py",
                   "benchmarks/library_loops.py", "benchmarks/loss_curves.py", "benchmarks/memory.py",
                   "benchmarks/memory_plan.py", "benchmarks/overhead.py", "benchmarks/startup.py",
                   "tests/test_benchmarks.py"],
    "peft": ["{pkg}/lora.py", "tests/test_lora.py"],
    "sweeps": ["{pkg}/sweep.py", "configs/sweeps", "scripts/sweep_local.sh", "scripts/slurm/sweep.sbatch",
               "tests/test_sweep.py"],
}


def unchosen_paths(answers: dict) -> list[Path]:
    """Every generated path that the answers did not ask for."""
    chosen = ENTRIES if answers["entry_points"] == "all" else (answers["entry_points"],)
    paths = []
    for entry in ENTRIES:
        if entry not in chosen:
            paths += [Path("src", SLUG, f"train_{entry}.py"), Path("tests", f"test_{entry}.py")]
    if "trainer" not in chosen:
        paths.append(Path("src", SLUG, "trainer_adapters.py"))
    if "pytorch" not in chosen:  # FSDP2 training is train_pytorch's (sharding.py also serves the benchmarks)
        paths.append(Path("tests", "test_fsdp.py"))
    # Accelerate and DeepSpeed launch the accelerate and trainer entry points, not plain PyTorch.
    slurm = Path("scripts", "slurm")
    if chosen == ("pytorch",):
        paths += [Path("configs", "accelerate"), Path("configs", "deepspeed"), slurm / "accelerate.sbatch",
                  slurm / "deepspeed.sbatch"]
    if chosen == ("pytorch",) or answers["deepspeed_stage"] == "none":
        paths.append(Path("configs", "experiments", "deepspeed.yaml"))
    if answers["deepspeed_stage"] == "none" and chosen != ("pytorch",):
        paths += [Path("configs", "deepspeed"), *Path("configs", "accelerate").glob("deepspeed_*.yaml"),
                  slurm / "deepspeed.sbatch"]
    baked = set(answers["__extras"].split(",")) - {""}
    kept = {path for name in baked for path in EXTRA_FILES[name]}
    paths += [Path(path.format(pkg=f"src/{SLUG}")) for name, files in EXTRA_FILES.items() if name not in baked
              for path in files if path not in kept]
    launchers = answers["__launchers"].split(",")
    if "slurm" not in launchers:
        paths.append(slurm)
    if "kubernetes" not in launchers:
        paths.append(Path("k8s"))
    if "skypilot" not in launchers:
        paths.append(Path("sky"))
    if "kubernetes" not in launchers and "skypilot" not in launchers:
        paths += [Path("scripts", "node_launch.sh"), Path("tests", "test_launchers.py")]
    if answers["ci"] != "github":
        paths.append(Path(".github"))
    if answers["ci"] != "gitlab":
        paths.append(Path(".gitlab-ci.yml"))
    if answers["ci"] == "none":
        paths.append(Path("scripts", "template_update.sh"))
    return paths


def main() -> None:
    for path in unchosen_paths(ANSWERS):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    replay = {k: v for k, v in ANSWERS.items() if not k.startswith("_") or k == "_template"}
    Path(".cookiecutter.json").write_text(json.dumps(replay, indent=2, sort_keys=True) + "\n")
    launchers = ANSWERS["__launchers"].split(",")
    clusters = [line for name, line in (
        ("slurm", "  sbatch scripts/slurm/torchrun.sbatch   # on a SLURM cluster\n"),
        ("kubernetes", "  kubectl apply -f k8s/jobset.yaml      # on Kubernetes (or k8s/trainjob.yaml)\n"),
        ("skypilot", "  sky jobs launch sky/train.yaml        # through SkyPilot\n")) if name in launchers]
    project = Path.cwd()  # cookiecutter runs this hook inside the new project, wherever -o put it
    shown = f"./{SLUG}" if Path(os.environ.get("PWD", "/")).resolve() == project.parent else shlex.quote(str(project))
    print(f"\nCreated {ANSWERS['project_name']!r} in {shown}. Next:\n"
          f"  cd {shown}\n"
          "  make install        # .venv with torch and this package\n"
          "  make train          # torchrun on this machine (every GPU, or 2 CPU processes)\n"
          + "".join(clusters))


if __name__ == "__main__":
    main()
