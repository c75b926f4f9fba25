"""Benchmarks of this project: what accumulation costs and saves, in numbers and plots
(docs/performance.md). Run them from the project root, each as `python -m benchmarks.<name>`
(`--help` lists the flags); `benchmarks.gpu_check` is in every bake, the others (and
`python -m benchmarks`, all of them) come with the extra `benchmarks`."""
