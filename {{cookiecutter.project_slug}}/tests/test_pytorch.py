"""What is particular to the plain-PyTorch entry point (the shared behaviour is in test_parity)."""

import pytest
import torch

from {{ cookiecutter.project_slug }}.checkpoint import load_rng, save_rng

from conftest import one_error_line, run_entry


@pytest.mark.slow
def test_pytorch_entry_refuses_deepspeed(env, tmp_path):
    proc = run_entry("pytorch", 1, tmp_path / "out", env, extra=["--deepspeed", "configs/deepspeed/zero2.json"])
    one_error_line(proc, "error: train_pytorch does not run DeepSpeed; use train_accelerate or train_trainer with "
                         "--deepspeed, or drop --deepspeed", exact=True)


class TwoGPUs:
    """torch.cuda's RNG calls as on a node with 2 GPUs: one beyond them raises IndexError, as torch's own do."""

    def __init__(self, monkeypatch):
        self.states = [torch.full((8,), i, dtype=torch.uint8) for i in range(2)]
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))

    def get_rng_state(self, device="cuda"):
        return self.states[torch.device(device).index].clone()

    def set_rng_state(self, state, device="cuda"):
        self.states[torch.device(device).index] = state.clone()

    def get_rng_state_all(self):
        return [state.clone() for state in self.states]

    def set_rng_state_all(self, states):
        for index, state in enumerate(states):
            self.set_rng_state(state, torch.device("cuda", index))


def test_each_process_saves_and_restores_its_own_gpus_rng_only(monkeypatch, tmp_path):
    """train_pytorch's checkpoints hold each process's own GPU's RNG state, restored on its own GPU: a job
    resumed on a node with fewer GPUs (2) than the one that saved it (8) continues, also from a checkpoint
    that lists the states of every GPU the process saw."""
    gpus, device = TwoGPUs(monkeypatch), torch.device("cuda", 1)
    torch.manual_seed(0)
    save_rng(tmp_path, 3, device)
    assert torch.load(tmp_path / "rng_rank3.pt", weights_only=True)["cuda"].equal(gpus.states[1])
    expected = torch.rand(3)
    gpus.states[1] = torch.zeros(8, dtype=torch.uint8)
    load_rng(tmp_path, 3, device)
    assert torch.rand(3).equal(expected) and [int(s[0]) for s in gpus.states] == [0, 1]
    saved = torch.load(tmp_path / "rng_rank3.pt", weights_only=True)
    saved["cuda"] = [torch.full((8,), 10 + i, dtype=torch.uint8) for i in range(8)]  # every GPU of its node
    torch.save(saved, tmp_path / "rng_rank3.pt")
    load_rng(tmp_path, 3, device)
    assert [int(s[0]) for s in gpus.states] == [0, 11]
    load_rng(tmp_path, 3, torch.device("cpu"))  # a CPU job: its GPU states are not restored
    assert [int(s[0]) for s in gpus.states] == [0, 11]
