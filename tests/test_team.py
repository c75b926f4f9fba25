"""A team's repository from day one: the CI answer's workflow (valid by its format's schema and
linter, its commands run in a bake), offline pre-commit hooks that pass on a fresh bake and refuse
keys, run folders and large files, the experiment overlays, and template updates through cruft."""

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, report
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

BIN = Path(sys.executable).parent
INSTALL = 'make install TORCH="torch --index-url https://download.pytorch.org/whl/cpu"'
CI_FILES = {"github": {".github/workflows/ci.yml"}, "gitlab": {".gitlab-ci.yml"}, "none": set()}


def tool(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})})


def git(project: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    proc = subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def commit_all(project: Path, message: str) -> None:
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", message)


def local_venv(project: Path) -> None:
    """A .venv for the project's Makefile that is this environment (pinned, offline): its
    `make install` is what CI runs, and it needs the network."""
    venv = project / ".venv"
    venv.mkdir()
    real = Path(sys.prefix)
    for name in ("bin", "lib", "include"):
        if (real / name).exists():
            (venv / name).symlink_to(real / name)
    shutil.copy(real / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / ".installed").touch()


@pytest.mark.parametrize("ci", ["github", "gitlab", "none"])
def test_the_ci_answer_chooses_the_workflow(baked, ci):
    project = baked(ci=ci)
    found = {p.relative_to(project).as_posix() for p in [*project.glob(".github/**/*"), project / ".gitlab-ci.yml"]
             if p.is_file()}
    assert found == CI_FILES[ci]
    assert (project / "scripts" / "template_update.sh").is_file() == (ci != "none")  # the template update job's
    assert json.loads((project / ".cookiecutter.json").read_text())["ci"] == ci


def workflow_steps(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def test_the_github_workflow_is_valid_and_runs_the_projects_own_targets(baked):
    project = baked(ci="github")
    workflow = project / ".github" / "workflows" / "ci.yml"
    schema = tool("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(workflow), cwd=project)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    lint = tool("zizmor", "--offline", "--no-progress", str(workflow), cwd=project)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    jobs = yaml.safe_load(workflow.read_text())["jobs"]
    assert workflow_steps(jobs["fast"]) == [INSTALL, "make lint", "make test"]
    assert workflow_steps(jobs["full"]) == [INSTALL, "make test-all"]
    assert "schedule" in jobs["full"]["if"] and "workflow_dispatch" in jobs["full"]["if"]
    assert jobs["template-update"]["if"] == jobs["full"]["if"]
    assert workflow_steps(jobs["template-update"])[0].startswith("pip install cruft\nscripts/template_update.sh\n")
    setup = next(step for step in jobs["fast"]["steps"] if step.get("uses", "").startswith("actions/setup-python@"))
    assert setup["with"]["cache"] == "pip" and setup["with"]["cache-dependency-path"] == "pyproject.toml"


def test_the_gitlab_pipeline_is_valid_and_runs_the_projects_own_targets(baked):
    project = baked(ci="gitlab")
    pipeline = project / ".gitlab-ci.yml"
    schema = tool("check-jsonschema", "--builtin-schema", "vendor.gitlab-ci", str(pipeline), cwd=project)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    config = yaml.safe_load(pipeline.read_text())
    assert config["default"]["before_script"] == [INSTALL]
    assert config["default"]["cache"]["key"]["files"] == ["pyproject.toml"]
    assert config["fast"]["script"] == ["make lint", "make test"]
    assert config["full"]["script"] == ["make test-all"]
    assert {"if": '$CI_PIPELINE_SOURCE == "schedule"'} in config["full"]["rules"]
    assert config["template-update"]["script"][:2] == ["pip install cruft", "scripts/template_update.sh"]


def baked_copy(baked, tmp_path: Path, **answers) -> Path:
    project = tmp_path / "project"
    shutil.copytree(baked(**answers), project)
    return project


@pytest.mark.slow
def test_the_workflows_commands_pass_in_a_bake(baked, tmp_path):
    """Every `run:` of the fast job after the install, in order, in a fresh bake whose .venv is this
    pinned environment, with the workflow's own environment variables. Its `make test` is the
    default bake's fast tier (test_bake runs that bake's slow tier)."""
    project = baked_copy(baked, tmp_path, ci="github")
    local_venv(project)
    workflow = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())
    env = {**os.environ, **workflow["env"], "WANDB_DIR": str(tmp_path / "wandb")}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    for command in workflow_steps(workflow["jobs"]["fast"])[1:]:
        proc = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
        lines = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("make[")] or [""]
        said = next((line for line in reversed(lines) if " passed" in line), lines[-1])  # pytest's summary
        report(f"CI step `{command}` in a bake: {said}")
    unit = subprocess.run("make test-unit", shell=True, cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)
    summary = next((line for line in reversed(unit.stdout.splitlines()) if " passed" in line), "")
    report(f"`make test-unit` in a bake: {summary.strip('= ')}")
    assert unit.returncode == 0 and "deselected" in summary, unit.stdout[-4000:]
    assert not re.search(r"\d+ failed", summary), unit.stdout[-4000:]


def installed_by_make_install(project: Path) -> set[str]:
    """The distributions `make install` puts in .venv: torch, the project's dependencies and the
    extras its recipe names, with everything they require (as this environment resolves them)."""
    extras = re.search(r"pip install --quiet -e '\.\[([a-z,]+)\]'", (project / "Makefile").read_text()).group(1)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    wanted = ["torch", *meta["dependencies"], *(r for e in extras.split(",") for r in meta["optional-dependencies"][e])]
    installed: set[str] = set()
    while wanted:
        requirement = Requirement(wanted.pop())
        name = canonicalize_name(requirement.name)
        if name in installed or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        installed.add(name)
        wanted += importlib.metadata.requires(name) or []
    return installed


def third_party_imports(project: Path) -> set[str]:
    """Every top-level module the project's code, tests and benchmarks import that is neither the
    standard library nor the project's own."""
    files = [p for p in project.rglob("*.py") if ".venv" not in p.parts]
    local = {project.name, *(p.stem for p in files), *(p.parent.name for p in files)}
    modules = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.partition(".")[0])
    return modules - local - set(sys.stdlib_module_names)


@pytest.mark.parametrize("answers", [{}, {"entry_points": "pytorch"}, {"entry_points": "trainer"},
                                     {"deepspeed_stage": "none"}, {"extras": "all", "deepspeed_stage": "none"}],
                         ids=lambda a: ",".join(a.values()) or "default")
def test_make_install_installs_every_module_the_project_imports(baked, answers):
    """CI runs `make install` and then the tests: a module they import that no requirement names
    would pass here (this environment has everything) and fail on a fresh machine."""
    project = baked(**answers)
    installed = installed_by_make_install(project)
    providers = importlib.metadata.packages_distributions()
    missing = {module: providers.get(module) for module in third_party_imports(project)
               if not installed & {canonicalize_name(d) for d in providers.get(module, [])}}
    assert missing == {}


def test_pre_commit_passes_on_a_fresh_bake_and_refuses_keys_runs_and_large_files(baked, tmp_path):
    project = baked_copy(baked, tmp_path)
    local_venv(project)
    git(project, "init", "-q")
    commit_all(project, "bake")
    env = {"PRE_COMMIT_HOME": str(tmp_path / "pre-commit")}
    run = tool("pre-commit", "run", "--all-files", cwd=project, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {line.split("..")[0] for line in run.stdout.splitlines() if line.endswith("Passed")} == {
        "ruff", "shellcheck", "no W&B keys, run folders or large files"}
    key = "0123456789abcdef" * 2 + "01234567"
    (project / "src" / "notes.py").write_text(f'WANDB_API_KEY = "{key}"\n')
    (project / "runs" / "default").mkdir(parents=True)
    (project / "runs" / "default" / "metrics.jsonl").write_text("{}\n")
    (project / "corpus.bin").write_bytes(b"\0" * (2 << 20))
    git(project, "add", "-f", "src/notes.py", "runs/default/metrics.jsonl", "corpus.bin")
    refused = tool("pre-commit", "run", cwd=project, env=env)
    assert refused.returncode == 1
    lines = [line for line in refused.stdout.splitlines() if line.startswith(("src/notes.py", "runs/", "corpus"))]
    assert lines == ["corpus.bin: 2,048 KiB, over 1,024 KiB (data belongs in data/, outside git)",
                     "runs/default/metrics.jsonl: inside runs/, which a run writes (see .gitignore)",
                     "src/notes.py:1: looks like a W&B API key; use `wandb login` or WANDB_API_KEY in the environment"]


def test_experiment_overlays_are_valid_configs(baked):
    for answers, overlays in (({}, {"gpt2_small", "long_context", "deepspeed"}),
                              ({"entry_points": "pytorch"}, {"gpt2_small", "long_context"}),
                              ({"deepspeed_stage": "none"}, {"gpt2_small", "long_context"})):
        project = baked(**answers)
        found = {p.stem for p in (project / "configs" / "experiments").glob("*.yaml")}
        assert found == overlays
        for name in found:
            path = f"configs/experiments/{name}.yaml"
            merged = subprocess.run([sys.executable, "-m", f"{project.name}.config", "--config", "configs/train.yaml",
                                     "--config", path], cwd=project, capture_output=True, text=True, timeout=120,
                                    env={**os.environ, "PYTHONPATH": "src"})
            assert merged.returncode == 0, merged.stderr
            config = yaml.safe_load(merged.stdout)  # the project's own loader: every key known, every value valid
            assert {k: config[k] for k in yaml.safe_load((project / path).read_text())} == \
                yaml.safe_load((project / path).read_text())
            if config["deepspeed"]:
                assert (project / config["deepspeed"]).is_file()


def template_repo(tmp_path: Path) -> Path:
    """The template's files in a git repository of their own, as cruft clones a template."""
    repo = tmp_path / "template"
    repo.mkdir()
    for name in ("cookiecutter.json", "hooks", "templates", "{{cookiecutter.project_slug}}"):
        copy = shutil.copytree if (TEMPLATE / name).is_dir() else shutil.copy
        copy(TEMPLATE / name, repo / name)
    for junk in [*repo.rglob("__pycache__"), *repo.rglob(".ruff_cache"), *repo.rglob(".pytest_cache")]:
        shutil.rmtree(junk)
    git(repo, "init", "-q")
    commit_all(repo, "template")
    return repo


def cruft(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return tool("cruft", *args, cwd=cwd, timeout=300)


def test_cruft_update_brings_template_changes_and_keeps_the_users(tmp_path):
    repo = template_repo(tmp_path)
    out = tmp_path / "out"
    created = cruft("create", str(repo), "--no-input", "--output-dir", str(out), "--extra-context",
                    json.dumps({"entry_points": "pytorch", "project_slug": "team_train"}), cwd=tmp_path)
    assert created.returncode == 0, created.stdout + created.stderr
    project = out / "team_train"
    state = json.loads((project / ".cruft.json").read_text())
    assert state["template"] == str(repo) and state["context"]["cookiecutter"]["entry_points"] == "pytorch"
    git(project, "init", "-q")
    commit_all(project, "start")
    assert cruft("check", cwd=project).returncode == 0

    # the team's change, committed
    config = project / "configs" / "train.yaml"
    assert "\nseed: 42\n" in config.read_text()
    config.write_text(config.read_text().replace("\nseed: 42\n", "\nseed: 1234\n"))
    commit_all(project, "our seed")
    # a template fix, committed in the template
    launching = repo / "{{cookiecutter.project_slug}}" / "docs" / "launching.md"
    launching.write_text(launching.read_text() + "\nA template fix.\n")
    commit_all(repo, "fix")
    assert cruft("check", cwd=project).returncode == 1  # out of date

    updated = cruft("update", "-y", cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert (project / "docs" / "launching.md").read_text().endswith("\nA template fix.\n")
    assert "seed: 1234" in config.read_text()
    assert cruft("check", cwd=project).returncode == 0
    commit_all(project, "template fix")

    # an answer changed later: the other loops arrive
    assert not (project / "src" / "team_train" / "train_accelerate.py").exists()
    changed = cruft("update", "-y", "--variables-to-update", json.dumps({"entry_points": "all"}), cwd=project)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    for entry in ("accelerate", "trainer"):
        assert (project / "src" / "team_train" / f"train_{entry}.py").is_file()
        assert (project / "tests" / f"test_{entry}.py").is_file()
    assert (project / "configs" / "accelerate" / "multi_gpu.yaml").is_file()
    assert json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]["entry_points"] == "all"
    assert "seed: 1234" in config.read_text()
    commit_all(project, "all loops")

    # an extra added later (docs/extending.md's command): its files and keys arrive, the team's edit stays
    assert not (project / "src" / "team_train" / "sharding.py").exists()
    extended = cruft("update", "-y", "--variables-to-update", json.dumps({"extras": "fsdp,doctor"}), cwd=project)
    assert extended.returncode == 0, extended.stdout + extended.stderr
    for module in ("fsdp", "sharding", "doctor", "hangs"):
        assert (project / "src" / "team_train" / f"{module}.py").is_file(), module
    assert not (project / "src" / "team_train" / "noise.py").exists()
    assert "\nfsdp: \"none\"\n" in config.read_text() and "seed: 1234" in config.read_text()


def test_the_scheduled_template_update_proposes_the_newest_tag_on_a_branch(tmp_path):
    """The CI job's script, run as a plain command: the template a bare repository tagged v1 then v2
    (a fix); the project, made from v1 and edited by its team, gets branch template-update holding
    v2's fix and the team's edit, its own branch untouched; up to date, or without .cruft.json, nothing."""
    work = template_repo(tmp_path)
    git(work, "tag", "v1")
    bare = tmp_path / "template.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    out = tmp_path / "out"
    created = cruft("create", str(bare), "--checkout", "v1", "--no-input", "--output-dir", str(out),
                    "--extra-context", json.dumps({"project_slug": "team_train", "ci": "github"}), cwd=tmp_path)
    assert created.returncode == 0, created.stdout + created.stderr
    project = out / "team_train"
    git(project, "init", "-q", "-b", "main")
    commit_all(project, "start")
    config = project / "configs" / "train.yaml"
    config.write_text(config.read_text().replace("\nseed: 42\n", "\nseed: 1234\n"))
    commit_all(project, "our seed")
    def update() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/template_update.sh"], cwd=project, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})

    current = update()
    assert current.returncode == 0 and "up to date" in current.stdout, current.stdout + current.stderr

    launching = work / "{{cookiecutter.project_slug}}" / "docs" / "launching.md"
    launching.write_text(launching.read_text() + "\nA template fix.\n")
    commit_all(work, "fix")
    git(work, "tag", "v2")
    git(work, "push", "-q", str(bare), "HEAD:refs/heads/main", "--tags")
    updated = update()
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert git(project, "branch", "--show-current").strip() == "template-update"
    assert (project / "docs" / "launching.md").read_text().endswith("\nA template fix.\n")
    assert "seed: 1234" in config.read_text() and not git(project, "status", "--porcelain")
    assert json.loads((project / ".cruft.json").read_text())["checkout"] == "v2"
    assert "A template fix." not in git(project, "show", "main:docs/launching.md")
    again = update()
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr

    (project / ".cruft.json").unlink()
    unlinked = update()
    assert unlinked.returncode == 0 and "no .cruft.json" in unlinked.stdout


def test_a_project_made_with_cookiecutter_joins_cruft_with_its_recorded_answers(tmp_path):
    repo = template_repo(tmp_path)
    baked = subprocess.run([sys.executable, "-m", "cookiecutter", str(repo), "--no-input", "-o", str(tmp_path / "out"),
                            "entry_points=trainer", "ci=none"], capture_output=True, text=True, timeout=120)
    assert baked.returncode == 0, baked.stderr
    project = tmp_path / "out" / "gacc_train"
    git(project, "init", "-q")
    commit_all(project, "start")
    linked = cruft("link", str(repo), "-y", "--extra-context", (project / ".cookiecutter.json").read_text(),
                   cwd=project)
    assert linked.returncode == 0, linked.stdout + linked.stderr
    answers = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert (answers["entry_points"], answers["ci"]) == ("trainer", "none")
    assert cruft("check", cwd=project).returncode == 0
    same = cruft("diff", "--exit-code", cwd=project)  # the recorded answers render this very project
    assert same.returncode == 0 and "diff --git" not in same.stdout, same.stdout[-3000:]
