"""The data path at the scale of a real job: for synthetic corpora of 10k, 100k and 1M documents,
2 processes of train_pytorch (torchrun, the tiny model) measure the one preparation (seconds, by
the process that did it), the time from launch to the first optimizer step on a cold start (the
cache empty) and a warm one (the same data again, another output_dir), the steady-state seconds
per optimizer step, and each rank's peak resident memory. Goal: a warm start and a step that cost
the same at every size (within 10 %), memory per rank far below the corpus, one preparation.

    python -m benchmarks.data                         # 10k, 100k, 1M documents (about 10 minutes on 2 cores)
    python -m benchmarks.data --sizes 10000 3000000   # other sizes
    python -m benchmarks.data --baseline ../old_bake  # the same runs of another checkout, for comparison
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT, SLUG, free_port, parser, subprocess_env, write_corpus
from .harness import figure, print_table, save_figure, save_results

STEPS = 40  # optimizer steps per run; steps 11-40 give the steady state
TIMEOUT_S = 3600
# Each rank reports its own peak resident memory when it exits: torchrun runs this in place of
# `-m <entry module>`, with the entry's module name first.
PEAK_RSS = """import atexit, os, resource, runpy, sys
out = os.environ["PEAK_RSS_DIR"]
atexit.register(lambda: open(f"{out}/rank{os.environ['RANK']}", "w").write(
    str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def launch(project: Path, corpus: Path, cache: Path | None, out: Path) -> dict:
    """One 2-process run of `project`; seconds to its first optimizer step, per step, peak RSS."""
    out.mkdir(parents=True)
    (out / "rss").mkdir()
    script = out / "peak_rss.py"
    script.write_text(PEAK_RSS)
    flags = ["--dataset", str(corpus), "--max_steps", str(STEPS), "--report_to", "none", "--eval_every", "1000",
             "--output_dir", str(out / "run")]
    # a baseline of an older commit may lack these keys
    flags += ["--data_cache_dir", str(cache), "--log_every", "1000"] if cache else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), f"{SLUG}.train_pytorch", *flags]
    env = {**subprocess_env(), "PYTHONPATH": str(project / "src"), "PEAK_RSS_DIR": str(out / "rss")}
    metrics = out / "run" / "metrics.jsonl"
    with (out / "log.txt").open("w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
        while not (metrics.is_file() and metrics.read_text()):
            if proc.poll() is not None or time.perf_counter() - start > TIMEOUT_S:
                raise RuntimeError(f"no first step:\n{(out / 'log.txt').read_text()[-3000:]}")
            time.sleep(0.02)
        first_step_s = time.perf_counter() - start
        if proc.wait(timeout=TIMEOUT_S):
            raise RuntimeError((out / "log.txt").read_text()[-3000:])
    elapsed = [r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    rss = [int((out / "rss" / f"rank{rank}").read_text()) for rank in (0, 1)]
    return {"first_step_s": round(first_step_s, 2),
            "step_s": round((elapsed[-1] - elapsed[9]) / (len(elapsed) - 10), 4),
            "peak_rss_mib": [round(r / 2**20, 1) for r in rss],
            "preparations": (out / "log.txt").read_text().count("data: preparing ")}


def run(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for documents in args.sizes:
            corpus = Path(tmp) / f"corpus_{documents}"
            corpus_mib = write_corpus(corpus, documents) / 2**20
            for name, project, cache in (("this project", ROOT, Path(tmp) / f"cache_{documents}"),
                                         *((("baseline", args.baseline, None),) if args.baseline else ())):
                cold = launch(project, corpus, cache, Path(tmp) / f"{name}_{documents}_cold".replace(" ", "_"))
                warm = launch(project, corpus, cache, Path(tmp) / f"{name}_{documents}_warm".replace(" ", "_"))
                prepared = json.loads(next(cache.glob("*/prepared.json")).read_text()) if cache else None
                rows.append({"code": name, "documents": documents, "corpus_mib": round(corpus_mib, 1),
                             "prepare_s": prepared["seconds"] if prepared else None,
                             "preparations": cold["preparations"] + warm["preparations"] if cache else None,
                             "cold_first_step_s": cold["first_step_s"], "warm_first_step_s": warm["first_step_s"],
                             "step_s": warm["step_s"], "peak_rss_mib": max(cold["peak_rss_mib"] + warm["peak_rss_mib"]),
                             "peak_rss_mib_per_rank": warm["peak_rss_mib"]})
                print(rows[-1], flush=True)
    report(args, rows)
    return rows


def report(args, rows: list[dict]) -> None:
    shown = [{**r, "prep": f"{r['prepare_s']:.1f}" if r["prepare_s"] is not None else "(every rank, every start)"}
             for r in rows]
    print_table("data: 2 processes, train_pytorch, tiny model, 40 steps (steady state: steps 11-40)",
                {"code": "{code}", "documents": "{documents:,}", "corpus MiB": "{corpus_mib:.0f}",
                 "prepare s": "{prep}", "cold first step s": "{cold_first_step_s:.1f}",
                 "warm first step s": "{warm_first_step_s:.1f}", "s/step": "{step_s:.4f}",
                 "peak RSS/rank MiB": "{peak_rss_mib:.0f}"}, shown)
    fig, ax = figure("Start-up and step time against the corpus size (2 processes)", "training documents", "seconds")
    for code, style in (("this project", "-"), ("baseline", ":")):
        mine = [r for r in rows if r["code"] == code]
        if mine:
            sizes = [r["documents"] for r in mine]
            ax.plot(sizes, [r["warm_first_step_s"] for r in mine], "o" + style, label=f"{code}: warm start to step 1")
            ax.plot(sizes, [r["cold_first_step_s"] for r in mine], "s" + style, label=f"{code}: cold start to step 1")
            ax.plot(sizes, [r["step_s"] * 100 for r in mine], "^" + style, label=f"{code}: 100 optimizer steps")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    save_figure(fig, args.results.parent / "data.png")
    save_results(args, "data", rows, {"processes": 2, "steps": STEPS, "steady_state_steps": "11-40",
                                      "entry": "train_pytorch"})


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--baseline", type=Path, help="a baked project of another commit, measured the same way")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
