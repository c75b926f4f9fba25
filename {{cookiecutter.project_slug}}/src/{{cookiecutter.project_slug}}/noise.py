"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A.1), from the
squared gradient norms DDP's communication hook reads before and after its all-reduce: no extra
backward pass. Smoothed by exponential moving averages; in examples. docs/batch.md derives the
estimator and says how to read it.
"""

import torch

from .distributed import sum_and_read


class NoiseScale:
    """Running estimate of B_simple; its two averages go into every checkpoint (a resumed run
    continues them exactly)."""

    SMOOTHING = 0.95  # per optimizer step: the estimate follows about the last 20 steps

    def __init__(self, sq_norm: float = 0.0, trace: float = 0.0, smoothing: float = SMOOTHING):
        self.sq_norm, self.trace, self.smoothing = sq_norm, trace, smoothing

    def state(self) -> list[float]:
        return [self.sq_norm, self.trace]

    def update(self, local_sq: float | None, reduced_sq: float | None, examples: int, world_size: int) -> dict:
        """One optimizer step's estimates from the ranks' mean squared gradient norm before the
        all-reduce (`local_sq`) and the squared norm after it (`reduced_sq`), for `examples` in the
        global batch. Returns the record's `grad_sq_norm` and `grad_trace` (this step's) and
        `grad_noise_scale` (smoothed) once both averages are positive; nothing without two ranks or a
        synchronised step."""
        if local_sq is None or world_size < 2:
            return {}
        b_big = float(examples)
        b_small = b_big / world_size
        sq_norm = (b_big * reduced_sq - b_small * local_sq) / (b_big - b_small)
        trace = (local_sq - reduced_sq) / (1 / b_small - 1 / b_big)
        keep = self.smoothing
        self.sq_norm = keep * self.sq_norm + (1 - keep) * sq_norm
        self.trace = keep * self.trace + (1 - keep) * trace
        values = {"grad_sq_norm": sq_norm, "grad_trace": trace}
        if self.sq_norm > 0 and self.trace > 0:  # the bias of the averages' zero start cancels here
            values["grad_noise_scale"] = self.trace / self.sq_norm
        return values


def read_norms(local_sq: torch.Tensor | None, reduced_sq: torch.Tensor | None,
               world_size: int) -> tuple[float | None, float | None]:
    """GradSyncCounter.take_norms' pair as NoiseScale.update takes it, with an all-reduce and a read
    of their own (the training loops fold both into their step's one: Session.read_step)."""
    if local_sq is None:
        return None, None
    local_sum, reduced = sum_and_read([local_sq], [reduced_sq])
    return local_sum / world_size, reduced
