"""Loop 3: the HF Transformers `Trainer`, in its textbook form: `TrainingArguments(...)`,
`Trainer(...)`, `trainer.train()`.

Launch: `python -m {{ cookiecutter.project_slug }}.train_trainer` (one process), under `torchrun` or
`accelerate launch`, or `ENTRY=trainer scripts/train_local.sh`; every flag overrides its key in
configs/train.yaml (`--help`). The Trainer runs the accumulation itself; `training_arguments()` is
where our config becomes TrainingArguments, and trainer_adapters.py replaces the defaults that
would make this loop train differently from the other two.
"""

import os
import shutil
import traceback
from functools import partial

from accelerate import PartialState
from safetensors.torch import load_model
from transformers import TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoint import after_a_failed_write, checkpoints_dir
from .cli import run_cli
from .config import TrainConfig
from .errors import JobFailed, first_line
from .model import build_model
from .optim import SCHEDULES
from .session import Session
from .speed import COMPILE
from .startup import Run, start
from .trainer_adapters import RunRecorder, WindowLoss, WindowTrainer, compute_metrics, eval_summaries


def training_arguments(cfg: TrainConfig, run: Run) -> TrainingArguments:
    """Our config as TrainingArguments; trainer_adapters.py replaces the defaults these cannot set. Checkpoints
    (`checkpoint-<N>`) go under checkpoints/; RunRecorder publishes each atomically as step_<N> (as loops 1, 2)."""
    return TrainingArguments(
        output_dir=str(checkpoints_dir(cfg.output_dir)),
        per_device_train_batch_size=run.plan.micro_batch_size,
        per_device_eval_batch_size=run.plan.micro_batch_size,
        gradient_accumulation_steps=run.plan.grad_accum_steps,
        max_steps=run.total_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=SCHEDULES[cfg.lr_scheduler_type],  # as build_scheduler; WindowTrainer builds it
        warmup_steps=cfg.warmup_steps,
        seed=cfg.seed,
        bf16=cfg.mixed_precision == "bf16",
        fp16=cfg.mixed_precision == "fp16",
        eval_strategy="steps" if cfg.eval_every else "epoch",  # `evaluation_strategy` before transformers 4.41
        eval_steps=min(cfg.eval_every, run.total_steps) or None,  # as Session.eval_due: the run's end at the latest
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or None,
        report_to="none",  # W&B goes through RunRecorder, with the keys every entry point uses
        deepspeed=run.deepspeed,  # --deepspeed or the accelerate config's JSON, its "auto" keys filled
        average_tokens_across_devices=True,
        ddp_bucket_cap_mb=cfg.ddp_bucket_cap_mb,  # passed on to DDP as is, fractions included
        ddp_broadcast_buffers=False,  # no buffer broadcast in every forward (distributed.wrap_ddp says why)
        ddp_find_unused_parameters=cfg.ddp_find_unused_parameters,
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": run.launch.sync_each_batch(cfg)}},
        disable_tqdm=True,
        logging_nan_inf_filter=False,  # its per-micro-step isnan() waits for the device; RunRecorder checks once
        torch_compile=cfg.compile,  # Accelerate's dynamo plugin, as train_accelerate (dynamic: train() sets it)
        torch_compile_backend=COMPILE["backend"] if cfg.compile else None,
        remove_unused_columns=False,
        label_names=["labels"],  # what the Trainer finds in a Hugging Face model's forward, also for a model_factory's
        use_cpu=run.env.device.type == "cpu",
    )


def train(cfg: TrainConfig) -> None:
    run = start(cfg, entry="trainer")  # every up-front check
    run.init_distributed()  # the process group the Trainer then uses
    if cfg.compile:  # the Trainer's dynamo plugin reads Accelerate's variable for dynamic shapes
        os.environ["ACCELERATE_DYNAMO_USE_DYNAMIC"] = str(COMPILE["dynamic"]).lower()
    if run.deepspeed and run.env.device.type == "cpu":  # TrainingArguments(use_cpu=True) starts no DeepSpeed group,
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # in which ZeRO-3 builds the model: Accelerate starts it (on
        PartialState(cpu=False)  # the group init_distributed made, LOCAL_RANK set), as TrainingArguments does on a GPU
    # before the model: under ZeRO-3 the arguments' DeepSpeed config has each rank build only its
    # partition of the weights, never the whole model
    args = training_arguments(cfg, run)
    model = build_model(cfg, run.model_config)
    session = Session(run, model)
    if run.start_step >= run.total_steps:  # trained to the end, stopped before final_model was saved
        load_model(model, str(run.resume / "model.safetensors"))
        session.save_model(model)
        return session.done()
    train_loader, _ = session.loaders()

    loss = WindowLoss(cfg.task)
    trainer = WindowTrainer(
        model=model,
        args=args,
        train_dataset=run.data["train"],
        eval_dataset=run.data["validation"],
        data_collator=train_loader.collate_fn,
        processing_class=run.tokenizer,
        compute_loss_func=loss,
        compute_metrics=partial(compute_metrics, task=cfg.task,
                                num_labels=getattr(run.model_config, "num_labels", 2)),
        preprocess_logits_for_metrics=partial(eval_summaries, task=cfg.task),
        session=session,
        train_loader=train_loader,
    )
    recorder = RunRecorder(session, trainer, loss)
    trainer.add_callback(recorder)
    try:
        trainer.train(resume_from_checkpoint=str(run.resume) if run.resume else None)
    except Exception as err:  # the Trainer writes its checkpoints itself: a failed write ends here
        failed_write = any(frame.name == "_save_checkpoint" for frame in traceback.extract_tb(err.__traceback__))
        remove_unpublished(cfg, unfinished_only=not failed_write)
        if not failed_write:
            raise
        raise JobFailed(f"could not write a checkpoint ({type(err).__name__}: {first_line(err)}); "
                        f"{after_a_failed_write(cfg.output_dir, err)}") from None

    if recorder.stopped:
        return session.stopped()
    session.save_final(trainer.save_model)
    session.done()


def remove_unpublished(cfg: TrainConfig, unfinished_only: bool) -> None:
    """The Trainer's checkpoint-<N> folders not published as step_<N> are never read. A process whose
    write failed removes them; another one that fails with it (it may have gone on writing into one
    after the first had removed it) removes those the Trainer had not finished (it writes
    trainer_state.json last)."""
    for partial_write in checkpoints_dir(cfg.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        if not (unfinished_only and (partial_write / TRAINER_STATE_NAME).exists()):
            shutil.rmtree(partial_write, ignore_errors=True)


def main() -> None:
    run_cli(train)


if __name__ == "__main__":
    main()
