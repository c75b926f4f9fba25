"""Sweeps: one config and a table of overrides, one training run per row (docs/launching.md).

`configs/sweeps/<name>.yaml` holds `rows` (mappings of config keys) and/or a `grid` (key: list of values,
every combination, the last key varying fastest; with both, each row x the grid), and may name `configs`
(default [configs/train.yaml]) and `output_root` (default runs/<name>). A row trains into
<output_root>/<key>=<value>,...: named by its values, so a requeue or a resubmission resumes it.

    python -m {{ cookiecutter.project_slug }}.sweep configs/sweeps/lr.yaml    # the rows, each checked as a run checks its config
    sbatch --array=0-5 scripts/slurm/sweep.sbatch configs/sweeps/lr.yaml
    scripts/sweep_local.sh configs/sweeps/lr.yaml                 # every row, one after another
"""

import argparse
import itertools
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from .cli import say
from .config import DEFAULT_CONFIG, as_flags, keys_where, load_config, unknown_keys, yaml_mapping
from .errors import ConfigError

FILE_KEYS = ("rows", "grid", "configs", "output_root")
# what a row may not set, and why
FIXED = {"output_dir": "each row trains into <output_root>/<its values>; set output_root",
         "resume_from_checkpoint": "every row resumes its own folder, with auto",
         "config": "the sweep file's configs list names the config files"}


@dataclass(frozen=True)
class Row:
    index: int
    values: dict  # the row's overrides, in the file's order
    output_dir: str
    flags: list  # the overrides as flags, --key value


@dataclass(frozen=True)
class Sweep:
    path: str
    rows: list
    configs: list

    def config_args(self) -> list[str]:
        return [arg for path in self.configs for arg in ("--config", path)]


def _values(path: str, where: str, values) -> dict:
    """A row's (or the grid's) keys: config keys that a row may set (ConfigError naming `where` and the key)."""
    if not isinstance(values, dict):
        kind = "a mapping of config keys to lists of values" if where == "grid" else "a mapping of config keys"
        raise ConfigError(f"{path}: {where} must be {kind}, got {values!r}")
    for key, value in values.items():
        if key in FIXED:
            raise ConfigError(f"{path}: {where}, key {key}: a sweep cannot set it ({FIXED[key]})")
        if key not in keys_where():
            raise unknown_keys([str(key)], f" in {path} {where}")
        if where == "grid" and not (isinstance(value, list) and value):
            raise ConfigError(f"{path}: grid key {key} must be a list of the values to sweep, got {value!r}")
    return values


def read_sweep(path: str) -> Sweep:
    """The sweep file's rows, in order: each of `rows` by the grid's combinations (ConfigError: one line)."""
    spec = yaml_mapping(path, "sweep file", "name a YAML file such as configs/sweeps/lr.yaml",
                        "rows and/or grid, configs, output_root")
    unknown = sorted(set(map(str, spec)) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; a sweep file holds {', '.join(FILE_KEYS)}")
    if spec.get("rows") is None and spec.get("grid") is None:
        raise ConfigError(f"{path} holds neither rows nor grid; give rows (a list of mappings of config keys) or a "
                          "grid (config key: list of values)")
    rows = spec.get("rows", [{}])
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{path}: rows must be a list of mappings of config keys, got {rows!r}")
    rows = [_values(path, f"row {i}", row) if "rows" in spec else {} for i, row in enumerate(rows)]
    grid = _values(path, "grid", spec.get("grid", {}))
    # every combination of the grid, the last key varying fastest
    combinations = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    configs = spec.get("configs", [DEFAULT_CONFIG])
    if not isinstance(configs, list) or not configs or not all(isinstance(c, str) for c in configs):
        raise ConfigError(f"{path}: configs must be a list of config files, got {configs!r}")
    overlap = [key for row in rows for key in row if key in grid]
    if overlap:
        raise ConfigError(f"{path}: key {overlap[0]} is in both a row and the grid; set it in one of them")
    root = Path(str(spec.get("output_root", Path("runs") / Path(path).stem)))
    table, folders = [], {}
    for index, values in enumerate({**row, **combination} for row in rows for combination in combinations):
        table.append(_row(path, index, values, root))
        if folders.setdefault(table[-1].output_dir, index) != index:
            raise ConfigError(f"{path}: rows {folders[table[-1].output_dir]} and {index} both train into "
                              f"{table[-1].output_dir}; make their values differ")
    return Sweep(path, table, configs)


def _row(path: str, index: int, values: dict, root: Path) -> Row:
    """Row `index`: its flags, and its folder named by its values ('/' in a value becomes '_')."""
    for key, value in values.items():
        if value is None:
            raise ConfigError(f"{path}: row {index}, key {key} has no value (YAML null); give one")
    try:
        flags = as_flags(values)
    except ConfigError as err:
        raise ConfigError(f"{path}: row {index}: {err}") from None
    texts = dict(zip(values, flags[1::2], strict=True))
    for key, text in texts.items():
        if "\n" in text:  # the launch scripts read a row one argument a line
            raise ConfigError(f"{path}: row {index}, key {key}: the value spans lines; give it on one line")
    name = ",".join(f"{key}={text.replace('/', '_')}" for key, text in texts.items()) or "defaults"
    return Row(index, values, str(root / name), flags)


def check(sweep: Sweep, flags: list[str]) -> None:
    """Each row's config as a run reads it (the configs, the row, then `flags`): a row that fails is
    one line naming the row and the key."""
    for flag in flags:
        if flag.startswith("--") and flag[2:].partition("=")[0] in FIXED:
            raise ConfigError(f"flag {flag}: a sweep cannot set it ({FIXED[flag[2:].partition('=')[0]]})")
    base = [*sweep.config_args(), "--output_dir", "runs", *flags]
    load_config(base)  # the configs and the flags on their own: their errors are their own
    for row in sweep.rows:
        try:
            load_config([*sweep.config_args(), *row.flags, "--output_dir", row.output_dir, *flags])
        except ConfigError as err:
            raise ConfigError(f"{sweep.path}: row {row.index}, key {_culprit(row, base, err)}: {err}") from None


def _culprit(row: Row, base: list[str], err: ConfigError) -> str:
    """The key of `row` that fails on its own, else those the error names, else all of them."""
    for key, value in row.values.items():
        try:
            load_config([*base, *as_flags({key: value})])
        except ConfigError:
            return key
    named = [key for key in row.values if key in str(err)]
    return ", ".join(named or row.values)


def line(row: Row) -> str:
    """`<index>\\t<output_dir>\\t<flags>`, each value quoted as a shell needs it."""
    return f"{row.index}\t{row.output_dir}\t{' '.join(shlex.quote(arg) for arg in row.flags)}"


def pick(sweep: Sweep, index: str) -> Row:
    """Row `index` (a job array's task index) of the sweep; one line where there is none."""
    count = len(sweep.rows)
    submit = f"submit with sbatch --array=0-{count - 1} scripts/slurm/sweep.sbatch {sweep.path}"
    if not index:
        raise ConfigError(f"no row index: a sweep runs as a job array, one task a row; {submit} "
                          "(DRY_RUN=1 SLURM_ARRAY_TASK_ID=<row> shows a row's command)")
    if not index.isdigit() or int(index) >= count:
        raise ConfigError(f"row {index} is beyond the {count} row{'s' if count > 1 else ''} of {sweep.path} "
                          f"(0-{count - 1}); {submit}")
    return sweep.rows[int(index)]


def refuse(message: str) -> None:
    """argparse's error as one line, exit 2."""
    say(f"{message}; usage: python -m {{ cookiecutter.project_slug }}.sweep [--row ROW] FILE [flags...]")
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--row", help="print row ROW only, one argument a line: its output_dir, its first config "
                                      "file, then --config for the others and its flags (the launch scripts read it)")
    parser.add_argument("file", help="the sweep file, e.g. configs/sweeps/lr.yaml")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="flags added to every row, e.g. --max_steps 100")
    parser.error = refuse
    args = parser.parse_args(argv)
    try:
        sweep = read_sweep(args.file)
        check(sweep, args.flags)
        if args.row is None:
            print("\n".join(line(row) for row in sweep.rows))
        else:
            row = pick(sweep, args.row)
            print("\n".join([row.output_dir, *sweep.config_args()[1:], *row.flags]))
    except ConfigError as err:
        say(err)
        sys.exit(2)


if __name__ == "__main__":
    main()
