"""Every benchmark in one command: start-up, memory, communication, checkpointing and loop overhead, each
printing its table and writing its key of bench/results.json, and the plots beside it
(docs/performance.md, "What accumulation costs and saves").

    python -m benchmarks                                            # CPU: the tiny model (make bench)
    python -m benchmarks --model gpt2-small --mixed_precision bf16  # a GPU (2 for communication)
"""

from . import checkpointing, communication, memory, overhead, startup
from .common import parser


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    for benchmark in (startup, memory, communication, checkpointing, overhead):  # start-up first: nothing cached yet
        benchmark.run(args)
    print(f"\nresults: {args.results}")


if __name__ == "__main__":
    main()
