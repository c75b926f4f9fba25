"""LoRA adapters (the peft extra): the adapters train alike in every entry point and on 1 or 2
processes, checkpoints hold the adapters and their optimizer state only and resume exactly,
final_model/ is a PEFT adapter folder that gives the trained model's logits, and the LoRA keys'
mistakes are one line and exit code 2 at start.
"""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from {{ cookiecutter.project_slug }} import extras
from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.lora import main as lora_main
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config

from conftest import (
    ACCUM,
    ENTRIES,
    ROOT,
    TOL,
    assert_same_training,
    last_records,
    max_loss_diff,
    one_error_line,
    report,
    run_entry,
)

CONFIG = str(ROOT / "configs" / "train.yaml")
ZERO3 = "configs/deepspeed/zero3.json"
# 2 processes x 4 micro-steps of 2, 8 steps; the checkpoint of step 4 is where the resume tests start
LORA = {**ACCUM, "lora_r": 4, "lora_alpha": 8, "learning_rate": 0.01, "save_steps": 4}
LINEAR = "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"  # the tiny Llama's block layers


def adapters(run) -> dict:
    return load_file(run.output_dir / "final_model" / "adapter_model.safetensors")


def max_adapter_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_lora_keys_are_resolved_and_checked_up_front(env, tmp_path):
    cfg = load_config(["--config", CONFIG, "--lora_r", "4"])
    assert cfg.lora_target_modules == LINEAR  # every linear layer of the blocks, not lm_head
    assert load_config(["--config", CONFIG, "--lora_r", "4", "--lora_target_modules", "q_proj, v_proj"]
                       ).lora_target_modules == "q_proj,v_proj"
    assert load_config(["--config", CONFIG]).lora_target_modules == ""  # LoRA off: nothing resolved
    for flags, expected in [(["--lora_r", "-1"], "lora_r must be >= 0"),
                            (["--lora_alpha", "0"], "lora_alpha must be > 0"),
                            (["--lora_dropout", "1"], "lora_dropout must be in \\[0, 1\\)"),
                            (["--lora_r", "4", "--lora_target_modules", "q_proj,qkv"], "'qkv' matches no linear"),
                            (["--lora_r", "4", "--model_factory", "helpers.factory_models:gru"], "model_factory"),
                            (["--lora_r", "4", "--task", "sequence_classification"], "sequence_classification")]:
        with pytest.raises(ConfigError, match=expected):
            load_config(["--config", CONFIG, *flags])
    out = tmp_path / "out"
    proc = run_entry(ENTRIES[0], 1, out, env, {"lora_r": 4, "lora_target_modules": "lm_head"})
    one_error_line(proc, "error: lora_target_modules 'lm_head' matches no linear layer of tiny; use names among "
                   f"{LINEAR}", exact=True)
    assert not out.exists()


def test_adapters_train_alike_in_every_entry_point(runs):
    reference = runs(ENTRIES[0], 2, **LORA)
    params = adapters(reference)
    assert params and all(".lora_A." in k or ".lora_B." in k for k in params)
    assert max(v.abs().max().item() for k, v in params.items() if ".lora_B." in k) > 0  # B starts at 0
    assert reference.steps[-1]["loss"] < reference.steps[1]["loss"] - 0.01  # it trained (step 1 has lr 0)
    for entry in ENTRIES:
        run = runs(entry, 2, **LORA)
        assert [(r["world_size"], r["grad_accum_steps"]) for r in run.steps] == [(2, 4)] * 8, entry
        assert all(r.get("grad_sync_calls", 1) == 1 for r in run.steps), entry  # the frozen base: no extra sync
        param_diff, loss_diff = max_adapter_diff(adapters(run), params), max_loss_diff(run, reference)
        report(f"lora {entry} vs {ENTRIES[0]} at 2x4: max |adapter diff| {param_diff:.3g}, "
               f"max |loss diff| {loss_diff:.3g}")
        assert param_diff <= TOL.param and loss_diff <= TOL.loss, entry
        config = json.loads((run.output_dir / "final_model" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str((run.output_dir / "base_model").resolve()), entry
        assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, LINEAR.split(","))


def test_chat_adapters_train_alike_on_one_or_two_processes_with_gradient_checkpointing(runs):
    """One process of 4 micro-steps of 4 against 2 processes of 4 micro-steps of 2 in the last entry point,
    which recomputes the frozen base's activations (non-reentrant checkpointing)."""
    chat = {**LORA, "task": "chat"}
    single = runs(ENTRIES[0], 1, **{**chat, "micro_batch_size": 4})
    other = runs(ENTRIES[-1], 2, **chat, gradient_checkpointing="true")
    diff, loss_diff = max_adapter_diff(adapters(single), adapters(other)), max_loss_diff(single, other)
    report(f"lora chat {ENTRIES[0]} 1x4 vs {ENTRIES[-1]} 2x4 with gradient_checkpointing: max |adapter diff| "
           f"{diff:.3g}, max |loss diff| {loss_diff:.3g}")
    assert diff <= TOL.param and loss_diff <= TOL.loss


class AdapterRun:
    """A run whose params() are its final adapters (assert_same_training's view of a run)."""

    def __init__(self, run):
        self.run, self.steps = run, run.steps

    def params(self) -> dict:
        return adapters(self.run)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_checkpoints_hold_the_adapters_and_resume_exactly(runs, entry, tmp_path):
    straight = runs(entry, 2, **LORA)
    checkpoint = straight.output_dir / "checkpoints" / "step_4"
    tensors = {k for p in checkpoint.glob("*.safetensors") for k in load_file(p)}
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors), (entry, sorted(tensors)[:5])
    resumed = continued(runs, straight, entry, tmp_path / "resumed")
    assert [(r["step"], r["world_size"]) for r in last_records(resumed)] == [(step, 2) for step in range(5, 9)]
    assert_same_training(AdapterRun(resumed), AdapterRun(Steps(straight, 4)))
    if entry != ENTRIES[0]:
        return
    # on another world size (the accumulation 4 -> 8), and not with another lora_r
    shutil.copytree(checkpoint, tmp_path / "on_one_process" / "checkpoints" / "step_4")
    single = runs.run(entry, 1, tmp_path / "on_one_process", {**LORA, "resume_from_checkpoint": "auto"})
    assert single.returncode == 0, single.stderr[-3000:]
    assert [r["grad_accum_steps"] for r in last_records(single)] == [8] * 4
    diff = max_adapter_diff(adapters(single), adapters(straight))
    report(f"lora resume {entry} from 2 processes on 1 (accumulation 4 -> 8): max |adapter diff| {diff:.3g}")
    assert diff <= TOL.param and max_loss_diff(single, Steps(straight, 4)) <= TOL.loss
    changed = run_entry(entry, 1, tmp_path / "on_one_process", runs.env,
                        {**LORA, "lora_r": 8, "resume_from_checkpoint": "auto"})
    one_error_line(changed, "was trained with lora_r 4, this run has lora_r 8")

    whole = runs.run(entry, 1, tmp_path / "whole", {**ACCUM, "max_steps": 1, "save_steps": 1})
    assert whole.returncode == 0, whole.stderr[-3000:]
    size, whole_size = (sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".pt")
                            and not p.name.startswith("rng")) for folder in (checkpoint, tmp_path / "whole" /
                                                                             "checkpoints" / "step_1"))
    report(f"lora checkpoint ({entry}: weights and optimizer state): {size:,} bytes; the whole model's "
           f"{whole_size:,} bytes")
    assert size < whole_size / 3


class Steps:
    """A run's records after step `after` (what a run resumed there records anew)."""

    def __init__(self, run, after: int):
        self.output_dir, self.steps = run.output_dir, [r for r in run.steps if r["step"] > after]


def continued(runs, run, entry: str, out: Path, **flags):
    """`entry` on 2 processes continuing `run` from its checkpoint of step 4, in `out`."""
    shutil.copytree(run.output_dir / "checkpoints" / "step_4", out / "checkpoints" / "step_4")
    resumed = runs.run(entry, 2, out, {**LORA, **flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


@pytest.mark.slow
@pytest.mark.skipif("fsdp" not in extras.BAKED or "pytorch" not in ENTRIES, reason="train_pytorch's FSDP2 not baked")
def test_fsdp2_continues_a_ddp_checkpoint_and_trains_the_same_adapters(runs, tmp_path):
    """The frozen base and its adapters sharded in the same FSDP2 units: steps 5-8 under FSDP2 from DDP's
    checkpoint of step 4; the final adapters gathered whole; its own sharded checkpoint holds adapters only."""
    ddp = runs("pytorch", 2, **LORA)
    out = tmp_path / "fsdp"
    fsdp = continued(runs, ddp, "pytorch", out, fsdp="full_shard")
    diff, loss_diff = max_adapter_diff(adapters(fsdp), adapters(ddp)), max_loss_diff(fsdp, Steps(ddp, 4))
    report(f"lora fsdp2 full_shard (steps 5-8, from DDP's step 4) vs DDP: max |adapter diff| {diff:.3g}, "
           f"max |loss diff| {loss_diff:.3g}")
    assert diff <= TOL.param and loss_diff <= TOL.loss
    index = pickle.loads((out / "checkpoints" / "step_8" / "dcp" / ".metadata").read_bytes())
    names = [name for name in index.state_dict_metadata if name.startswith("model.")]
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ZERO3).is_file() or "accelerate" not in ENTRIES, reason="no DeepSpeed configs")
def test_zero3_trains_the_same_adapters_saves_them_whole_and_resumes_exactly(runs, tmp_path):
    """Each rank builds its partition of the base; the adapters come out whole (not empty), the base_model/
    whole, its checkpoints without the frozen weights, and a resume is bitwise."""
    ddp = runs("accelerate", 2, **LORA)
    zero3 = runs("accelerate", 2, **LORA, deepspeed=ZERO3)
    params = adapters(zero3)
    assert params.keys() == adapters(ddp).keys() and all(value.numel() for value in params.values())
    diff, loss_diff = max_adapter_diff(params, adapters(ddp)), max_loss_diff(zero3, ddp)
    report(f"lora deepspeed zero3 vs DDP (accelerate, 2x4): max |adapter diff| {diff:.3g}, "
           f"max |loss diff| {loss_diff:.3g}")
    assert diff <= TOL.param and loss_diff <= TOL.loss
    base, ddp_base = (load_file(run.output_dir / "base_model" / "model.safetensors") for run in (zero3, ddp))
    assert base.keys() == ddp_base.keys() and all(torch.equal(base[k], ddp_base[k]) for k in base)
    checkpoint = zero3.output_dir / "checkpoints" / "step_4"
    states = sum(p.stat().st_size for p in checkpoint.rglob("*_model_states.pt"))
    report(f"lora deepspeed zero3 checkpoint: model states {states:,} bytes, the frozen base "
           f"{(zero3.output_dir / 'base_model' / 'model.safetensors').stat().st_size:,} bytes")
    assert states < (zero3.output_dir / "base_model" / "model.safetensors").stat().st_size / 2
    resumed = continued(runs, zero3, "accelerate", tmp_path / "resumed", deepspeed=ZERO3)
    assert_same_training(AdapterRun(resumed), AdapterRun(Steps(zero3, 4)))


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ZERO3).is_file() or not {"accelerate", "trainer"} <= set(ENTRIES),
                    reason="no DeepSpeed configs, or not both entry points")
def test_the_trainer_under_zero3_trains_the_same_adapters_into_small_checkpoints(runs, tmp_path):
    """The Trainer builds the base partitioned too (DeepSpeed's group exists before it builds the model), trains
    the adapters train_accelerate's ZeRO-3 trains, its checkpoints leave the frozen base out, and a resume is
    bitwise."""
    zero3, trainer = (runs(entry, 2, **LORA, deepspeed=ZERO3) for entry in ("accelerate", "trainer"))
    diff, loss_diff = max_adapter_diff(adapters(trainer), adapters(zero3)), max_loss_diff(trainer, zero3)
    report(f"lora deepspeed zero3, trainer vs accelerate (2x4): max |adapter diff| {diff:.3g}, "
           f"max |loss diff| {loss_diff:.3g}")
    assert diff <= TOL.param and loss_diff <= TOL.loss
    checkpoint = trainer.output_dir / "checkpoints" / "step_4"
    states = sum(p.stat().st_size for p in checkpoint.rglob("*_model_states.pt"))
    assert 0 < states < (trainer.output_dir / "base_model" / "model.safetensors").stat().st_size / 2
    resumed = continued(runs, trainer, "trainer", tmp_path / "resumed", deepspeed=ZERO3)
    assert_same_training(AdapterRun(resumed), AdapterRun(Steps(trainer, 4)))


def test_final_model_loads_with_peft_to_the_trained_logits_and_merges(runs, tmp_path):
    run = runs(ENTRIES[0], 2, **LORA)
    final = run.output_dir / "final_model"
    loaded = AutoPeftModelForCausalLM.from_pretrained(final).eval()
    # the model the loops train, built as they build it, with the trained adapters set into it
    cfg = load_config(["--config", CONFIG, *[a for k, v in LORA.items() for a in (f"--{k}", str(v))],
                       "--output_dir", str(tmp_path / "rebuilt")])
    trained = build_model(cfg, model_config(cfg, load_tokenizer(cfg))).eval()
    assert not set_peft_model_state_dict(trained, adapters(run)).unexpected_keys
    base = AutoModelForCausalLM.from_pretrained(run.output_dir / "base_model").eval()
    tokens = torch.arange(40).view(2, 20) % base.config.vocab_size
    with torch.no_grad():
        logits = loaded(input_ids=tokens).logits
        assert torch.equal(logits, trained(input_ids=tokens).logits)
        assert not torch.allclose(logits, base(input_ids=tokens).logits, atol=1e-3)  # the adapters change them
    assert lora_main(["merge", str(final), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        diff = (merged(input_ids=tokens).logits - logits).abs().max().item()
    report(f"lora merged model vs adapters: max |logit diff| {diff:.3g}")
    assert diff <= 1e-4
    assert lora_main(["merge", str(tmp_path), str(tmp_path / "nothing")]) == 2
