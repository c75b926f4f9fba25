"""`make demo`: bake the template with its defaults and every extra (`extras=all`: the plots come
from the benchmarks and the noise scale) into a temporary folder, train the project
with each of its three entry points on 2 CPU processes (torchrun, gloo on loopback, the same seed
and data), and plot their loss per optimizer step on one figure, `docs/loss_curves.png` of the
baked project (the curves overlap: the entry points train the same), and the gradient noise scale
of the first run against its global batch, `docs/noise_scale.png`.

The project ships such figures (the generated README and docs/batch.md show them); to refresh the
template's copies from a demo, copy the printed PNGs to `{{cookiecutter.project_slug}}/docs/`."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
ENTRIES = ("pytorch", "accelerate", "trainer")
TRAIN_TIMEOUT_S = 600


def train(project: Path, entry: str, run_dir: Path, env: dict) -> int:
    cmd = ["scripts/train_local.sh", "--output_dir", str(run_dir)]
    print(f"\n$ cd {project} && ENTRY={entry} NPROC_PER_NODE=2 {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=project, env={**env, "ENTRY": entry}, timeout=TRAIN_TIMEOUT_S).returncode


def main() -> int:
    out = Path(tempfile.mkdtemp(prefix="gacc-demo-"))
    project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out), extra_context={"extras": "all"}))
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    runs = [project / "runs" / "demo" / entry for entry in ENTRIES]
    for entry, run_dir in zip(ENTRIES, runs, strict=True):
        code = train(project, entry, run_dir, env)
        if code:
            return code
    figure = project / "docs" / "loss_curves.png"
    noise = project / "docs" / "noise_scale.png"
    plot = [sys.executable, "-m", "benchmarks.loss_curves", *map(str, runs), "--out", str(figure),
            "--title", "Training loss per optimizer step: 3 entry points, 2 CPU processes each",
            "--noise", str(noise)]
    code = subprocess.run(plot, cwd=project, env={**env, "PYTHONPATH": "src"}, timeout=TRAIN_TIMEOUT_S).returncode
    if code == 0:
        print(f"\nbaked project:  {project}\nruns:           {runs[0].parent}/<entry>/ (metrics.jsonl, final_model/)"
              f"\nloss curves:    {figure}\nnoise scale:    {noise}")
    return code


if __name__ == "__main__":
    sys.exit(main())
