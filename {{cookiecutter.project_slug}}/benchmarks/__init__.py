"""Benchmarks of this project: what accumulation costs and saves, in numbers and plots (README,
"Performance"). Run them from the project root: `python -m benchmarks` (all) or
`python -m benchmarks.<name>`; `--help` lists the flags."""
