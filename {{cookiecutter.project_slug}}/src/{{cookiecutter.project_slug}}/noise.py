"""The gradient noise scale: which global batch pays.

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018), appendix A.1: the
"simple" noise scale B_simple = tr(Σ) / |G|², Σ the per-example gradients' covariance and G
the true gradient. Far below B_simple a larger global batch trains as fast in fewer steps; far
above it, the extra examples are mostly wasted compute.

It costs no extra backward pass: with DDP each rank's gradient before the all-reduce is that of
a batch of b = B / world_size examples, the all-reduced one that of B (the communication hook in
distributed.GradSyncCounter reads both squared norms, as k-diffusion's gns.py does). Since
E|G_b|² = |G|² + tr(Σ)/b, two batch sizes give unbiased estimates of both:

    |G|²  = (B |G_B|² - b |G_b|²) / (B - b)        tr(Σ) = (|G_b|² - |G_B|²) / (1/b - 1/B)

Each step's estimates are noisy (either may be negative); their exponential moving averages are
divided, as in the paper and k-diffusion. Units: examples (sequences, or packed blocks), the
units of global_batch_size. |G_b|² is averaged over the ranks (one tiny all-reduce per step).
"""

import torch

from .distributed import all_reduce_sum


class NoiseScale:
    """Running estimate of B_simple; its two averages go into every checkpoint (a resumed run
    continues them exactly)."""

    SMOOTHING = 0.95  # per optimizer step: the estimate follows about the last 20 steps

    def __init__(self, sq_norm: float = 0.0, trace: float = 0.0, smoothing: float = SMOOTHING):
        self.sq_norm, self.trace, self.smoothing = sq_norm, trace, smoothing

    def state(self) -> list[float]:
        return [self.sq_norm, self.trace]

    def update(self, local_sq: torch.Tensor | None, reduced_sq: torch.Tensor | None, examples: int,
               world_size: int) -> dict:
        """One optimizer step's estimates from this rank's squared gradient norm before the
        all-reduce (`local_sq`) and after it (`reduced_sq`), for `examples` in the global batch.
        Returns the record's `grad_sq_norm` and `grad_trace` (this step's) and `grad_noise_scale`
        (smoothed) once both averages are positive; nothing without two ranks or a synchronised step."""
        if local_sq is None or world_size < 2:
            return {}
        local_sq = all_reduce_sum(local_sq.detach().double().clone()) / world_size  # the ranks' mean
        small, big = torch.stack([local_sq, reduced_sq.detach().double()]).tolist()
        b_big = float(examples)
        b_small = b_big / world_size
        sq_norm = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1 / b_small - 1 / b_big)
        keep = self.smoothing
        self.sq_norm = keep * self.sq_norm + (1 - keep) * sq_norm
        self.trace = keep * self.trace + (1 - keep) * trace
        values = {"grad_sq_norm": sq_norm, "grad_trace": trace}
        if self.sq_norm > 0 and self.trace > 0:  # the bias of the averages' zero start cancels here
            values["grad_noise_scale"] = self.trace / self.sq_norm
        return values
