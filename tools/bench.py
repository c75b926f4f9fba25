"""`make bench`: bake the template with its defaults and every extra (`extras=all`: the benchmarks
are one) into a temporary folder (timed: the bake of the start-up benchmark, through the
cookiecutter CLI as a user types it), then run the baked
project's benchmarks (`python -m benchmarks`) with this environment's Python. The results land
in bench/ here: results.json and the plots. Arguments go to the benchmarks, e.g.
`python tools/bench.py --model gpt2-small --mixed_precision bf16` on a GPU machine."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
RESULTS = TEMPLATE / "bench" / "results.json"
BAKE_TIMEOUT_S, BENCH_TIMEOUT_S = 120, 3600


def bake(out: Path) -> tuple[Path, float]:
    """The default project with every extra, baked into `out` by `cookiecutter TEMPLATE --no-input
    extras=all`, and its seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cookiecutter", str(TEMPLATE), "--no-input", "extras=all", "-o", str(out)],
                   check=True, capture_output=True, timeout=BAKE_TIMEOUT_S)
    seconds = time.perf_counter() - start
    (project,) = [p for p in out.iterdir() if p.is_dir()]
    return project, seconds


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="gacc-bench-") as tmp:
        project, bake_s = bake(Path(tmp))
        print(f"baked {project} in {bake_s:.2f} s", flush=True)
        env = {**os.environ, "PYTHONPATH": "src", "HF_HUB_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        cmd = [sys.executable, "-m", "benchmarks", "--results", str(RESULTS), "--bake_s", f"{bake_s:.3f}",
               *sys.argv[1:]]
        return subprocess.run(cmd, cwd=project, env=env, timeout=BENCH_TIMEOUT_S).returncode


if __name__ == "__main__":
    sys.exit(main())
