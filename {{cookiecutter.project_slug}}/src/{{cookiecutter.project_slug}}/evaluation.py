"""Evaluation metrics, computed the same way by every entry point: each rank evaluates its strided
shard of the validation set and the sums are added across ranks (independent of the world size).
"""

import math

import numpy as np
import torch

from .distributed import all_reduce_sum
from .model import count_targets, summed_loss


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_labels: int) -> np.ndarray:
    keep = labels >= 0
    return np.bincount(labels[keep] * num_labels + preds[keep], minlength=num_labels**2).reshape(num_labels, num_labels)


def eval_metrics(loss_sum: float, targets: float, confusion: np.ndarray | None) -> dict[str, float]:
    """THE evaluation metrics of every entry point (the Trainer's compute_metrics calls it too), from sums over the
    whole validation set: the summed loss, the real targets and, for classification, the confusion matrix (rows:
    truth, columns: prediction; None for causal_lm). A metric added here is in every eval record."""
    loss = loss_sum / max(targets, 1.0)
    metrics = {"eval_loss": loss}
    if confusion is None:
        metrics["eval_perplexity"] = math.exp(min(loss, 50.0))
    else:  # F1 is that of class 1 for two classes (the usual binary F1), else the macro average
        confusion = np.asarray(confusion, dtype=np.float64)
        tp = np.diag(confusion)
        precision = np.divide(tp, confusion.sum(0), out=np.zeros_like(tp), where=confusion.sum(0) > 0)
        recall = np.divide(tp, confusion.sum(1), out=np.zeros_like(tp), where=confusion.sum(1) > 0)
        f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=precision + recall > 0)
        metrics["eval_accuracy"] = float(tp.sum() / max(confusion.sum(), 1.0))
        metrics["eval_f1"] = float(f1[1] if len(f1) == 2 else f1.mean())
    return metrics


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, task: str, device: torch.device, autocast) -> dict:
    """eval_metrics of the validation set, every rank evaluating its shard."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    confusion = np.zeros((0, 0))  # classification: truth x prediction, as many classes as the logits have
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with autocast():
            logits = model(**batch).logits
        totals[0] += summed_loss(logits, labels, task).double()
        totals[1] += count_targets(labels, task)
        if task == "sequence_classification":  # every rank runs at least one batch (eval_dataloader): one shape
            cm = confusion_matrix(labels.cpu().numpy(), logits.argmax(-1).cpu().numpy(), logits.shape[-1])
            confusion = confusion + cm if confusion.size else cm
    all_reduce_sum(totals)
    confusion = all_reduce_sum(torch.as_tensor(confusion, dtype=torch.float64, device=device))
    model.train(was_training)
    return eval_metrics(*totals.tolist(), confusion.cpu().numpy() if task == "sequence_classification" else None)
