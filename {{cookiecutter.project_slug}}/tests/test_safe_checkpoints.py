"""The safe_checkpoints extra: a resume reads each file of the checkpoint before loading it, and a
pickle that would run code (also one that hides what it imports), a damaged one, or a sharded
checkpoint's index that names more than DCP's own records is one line naming the file and the older
checkpoint that loads. Nothing runs."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from {{ cookiecutter.project_slug }}.checkpoint_checks import check_file
from {{ cookiecutter.project_slug }}.extras import BAKED

from conftest import ENTRIES, ROOT, one_error_line

# One process, 2 checkpoints: a run stopped after step 4 of 6 (checkpoints at steps 2 and 4).
STOPPED = {"micro_batch_size": 4, "global_batch_size": 16, "max_steps": 6, "save_steps": 2, "stop_after_steps": 4,
           "save_total_limit": 0}

# A pickle that calls os.system("touch PWNED"): it pushes "posix", "system" and two harmless names,
# pops those two and imports with STACK_GLOBAL, which takes the two values then on top of the stack
HIDDEN_IMPORT = (b"\x80\x04\x8c\x05posix\x8c\x06system\x8c\x0bcollections\x8c\x0bOrderedDict00\x93"
                 b"\x8c\x0btouch PWNED\x85R.")


class RunsCode:
    """Pickles as a call of os.system: loading it with pickle would run a command."""

    def __reduce__(self):
        return os.system, ("touch PWNED",)


def damage(folder, how: str) -> str:
    """Replace a torch file of a copy of a checkpoint the way `how` says; the file, by name."""
    target = min((p for p in folder.iterdir() if p.suffix in (".pt", ".bin", ".pth", ".pkl")),
                 key=lambda p: p.stat().st_size)
    if how == "garbage":  # of the same size
        target.write_bytes(os.urandom(target.stat().st_size))
    elif how == "runs_code":  # a valid torch file, with a trap in it
        torch.save({"state": torch.zeros(2), "trap": RunsCode()}, target)
    else:  # os.system imported by a STACK_GLOBAL from strings a POP hides
        target.write_bytes(HIDDEN_IMPORT)
    state = json.loads((folder / "state.json").read_text())
    # its size alone, as an older version recorded (no checksums): only reading the pickle tells
    state["files"][target.name] = target.stat().st_size
    (folder / "state.json").write_text(json.dumps(state))
    return target.name


@pytest.mark.slow
@pytest.mark.parametrize("how,expected", [("runs_code", "would run code when loaded (its pickle names posix.system"),
                                          ("hides_its_import", "would run code when loaded (its pickle names an "
                                                               "import it hides"),
                                          ("garbage", "is damaged")])
def test_a_checkpoint_that_would_not_load_safely_is_one_line_naming_the_one_that_loads(runs, tmp_path, how,
                                                                                       expected):
    out = tmp_path / "copy"
    shutil.copytree(runs(ENTRIES[0], 1, **STOPPED).output_dir, out)
    newest = out / "checkpoints" / "step_4"
    name = damage(newest, how)
    proc = runs.run(ENTRIES[0], 1, out, {**STOPPED, "resume_from_checkpoint": "auto"})
    line = one_error_line(proc, f"error: checkpoint {newest} cannot be loaded: {newest / name} {expected}")
    assert line.endswith(f"the older checkpoint {out / 'checkpoints' / 'step_2'} loads: --resume_from_checkpoint "
                         f"{out / 'checkpoints' / 'step_2'}")
    assert not (ROOT / "PWNED").exists() and not (tmp_path / "PWNED").exists()


@pytest.mark.skipif("fsdp" not in BAKED, reason="sharded checkpoints are the fsdp extra's")
def test_a_sharded_checkpoints_index_may_hold_only_dcps_own_records(tmp_path):
    """DCP reads a sharded checkpoint's `.metadata` with a plain pickle.load: it must name only DCP's
    record classes (also where a pickle hides what it imports) and build DCP's Metadata."""
    dcp.save({"weight": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    index = tmp_path / "dcp" / ".metadata"
    assert check_file(index) == ""
    for data, expected in ((HIDDEN_IMPORT, "would run code when loaded (its pickle names an import it hides)"),
                           (pickle.dumps({"hello": 1}), "is not the index of a sharded checkpoint")):
        index.write_bytes(data)
        assert check_file(index).startswith(expected)
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()
