"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A.1), from the
squared gradient norms DDP's communication hook reads before and after its all-reduce: no extra
backward pass. Smoothed by exponential moving averages; in examples. The batch_schedule extra's:
DDP's hook reads the norms (NoisyGradSyncCounter), a Session records the estimate (SessionNoise).
docs/batch.md derives the estimator and says how to read it.
"""

import torch

from .distributed import GradSyncCounter, sum_and_read


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


class NoisyGradSyncCounter(GradSyncCounter):
    """distributed.GradSyncCounter that also reads each bucket's squared norms, per parameter, before
    and after its all-reduce (`noise` False: it only counts). `take_norms()` returns and resets."""

    def __init__(self, ddp_model) -> None:
        self.noise = True
        self._index = {id(p): i for i, p in enumerate(ddp_model.module.parameters())}
        self._local: list[tuple[list[int], torch.Tensor]] = []  # (parameter indices, their squared norms)
        self._reduced: list[tuple[list[int], torch.Tensor]] = []
        super().__init__(ddp_model)

    def squared_norms(self, flat: torch.Tensor, bucket) -> tuple[list[int], torch.Tensor]:
        """Per parameter: DDP's buckets change after the first step and in a resumed job."""
        params = bucket.parameters()
        views = flat.split([p.numel() for p in params])
        norms = torch._foreach_norm(views, dtype=torch.promote_types(flat.dtype, torch.float32))
        return [self._index[id(p)] for p in params], torch.stack(norms).double().square()

    def hook(self, state, bucket):
        if not self.noise:
            return super().hook(state, bucket)
        self._local.append(self.squared_norms(bucket.buffer(), bucket))  # before the all-reduce averages it

        def reduced(future) -> torch.Tensor:
            averaged = future.value()
            self._reduced.append(self.squared_norms(averaged, bucket))
            return averaged

        return super().hook(state, bucket).then(reduced)

    def take_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(this rank's squared gradient norm, the averaged one's) since the last call, summed in the
        parameters' order; (None, None) without a synchronised step."""
        taken, self._local, self._reduced = (self._local, self._reduced), [], []
        if not all(taken):
            return None, None
        sums = []
        for parts in taken:  # gathered on the host: indexing the device tensor with a list would copy it there
            per_param, zero = {}, parts[0][1].new_zeros(())
            for indices, values in parts:
                for index, value in zip(indices, values.unbind(), strict=True):
                    per_param[index] = per_param.get(index, zero) + value
            sums.append(torch.stack([per_param.get(index, zero) for index in range(len(self._index))]).sum())
        return sums[0], sums[1]


def read_norms(local_sq: torch.Tensor | None, reduced_sq: torch.Tensor | None,
               world_size: int) -> tuple[float | None, float | None]:
    """NoisyGradSyncCounter.take_norms' pair as NoiseScale.update takes it, with an all-reduce and a
    read of their own (the training loops fold both into their step's one: Session.read_step)."""
    if local_sq is None:
        return None, None
    local_sum, reduced = sum_and_read([local_sq], [reduced_sq])
    return local_sum / world_size, reduced


class SessionNoise:
    """The noise scale as a Session keeps it (session.Session.noise): the squared norms join the
    step's one all-reduce and read (Session.read_step), the estimate joins each step's record
    (`grad_sq_norm`, `grad_trace`, `grad_noise_scale`) and its averages every checkpoint (`grad_noise`)."""

    def __init__(self, session):
        self.session = session
        self.scale = NoiseScale(*session.run.recorded.get("grad_noise", ()))
        self.norms: tuple[float | None, float | None] = (None, None)  # the latest step's, as update takes them
        self.synced = False  # the latest step read DDP's buckets

    def slots(self) -> tuple[list, list]:
        """The step's squared norms for read_step: (summed over ranks, this rank's)."""
        counter = self.session.sync_counter
        local_sq, reduced_sq = counter.take_norms() if counter else (None, None)
        self.synced = local_sq is not None
        return [0.0 if local_sq is None else local_sq], [0.0 if reduced_sq is None else reduced_sq]

    def read(self, values: list[float]) -> None:
        """The slots' values as read_step read them."""
        local, reduced = values
        self.norms = (local / self.session.env.world_size, reduced) if self.synced else (None, None)

    def record(self, window, values: dict) -> dict:
        """The step's estimates, where every rank's gradient is of the same number of examples (not
        in an epoch's uneven last window); not under fp16, whose loss scale changes the units."""
        examples, world_size, cfg = len(window.examples), self.session.env.world_size, self.session.cfg
        even = examples % world_size == 0 and cfg.ddp_no_sync
        if not even or cfg.mixed_precision == "fp16" or values.get("step_skipped"):
            return {}
        return self.scale.update(*self.norms, examples, world_size)

    def state(self) -> dict:
        return {"grad_noise": self.scale.state()}
