"""Loss scaling for fp16, with DeepSpeed's update rule and a count of skipped steps.

fp16 gradients underflow unless the loss is multiplied by a large scale before
backward; too large a scale overflows to inf/nan instead, and that step must be
skipped on every rank. The engine asks `scale`, multiplies the loss, checks the
gradients (all-reduced, so every rank agrees), and calls `update(overflow)`
once per optimizer step. Skips are counted so they can be reported, never silent.

`DynamicLossScaler.update` is DeepSpeed's `DynamicLossScaler.update_scale`
(deepspeed/runtime/fp16/loss_scaler.py): `hysteresis` (DeepSpeed's
`delayed_shift`) overflows are tolerated before the scale halves; the scale
doubles when `loss_scale_window` steps have passed since the last overflow
(counted the DeepSpeed way: the (window+1)-th good step, then every window).
"""

from __future__ import annotations

from typing import Any

from zeroshard.policies import ConfigError, LossScalePolicy, ZeroShardError

__all__ = ["LossScaler", "DynamicLossScaler", "GradScalerRule", "make_loss_scaler"]


class LossScaler:
    """A fixed scale: fp16 with `loss_scale` set, and bf16/fp32 with scale 1.0. An overflow
    still skips the step (the engine's job) and is counted here."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ConfigError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)
        self.skipped_steps = 0  # all steps skipped for overflow, since the start
        self.consecutive_skips = 0  # skips since the last good step

    def update(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step."""
        if overflow:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.scale = float(d["scale"])
        self.skipped_steps = int(d["skipped_steps"])
        self.consecutive_skips = int(d["consecutive_skips"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale:g}, skipped_steps={self.skipped_steps})"


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic scale: halve on overflow (after hysteresis), double after a clean window."""

    dynamic = True

    def __init__(self, initial_scale: float = 2.0**16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0,
                 raise_at_min_scale: bool = False) -> None:
        super().__init__(initial_scale)
        if loss_scale_window < 1 or hysteresis < 1 or not min_loss_scale > 0:
            raise ConfigError("dynamic loss scaling needs loss_scale_window >= 1, hysteresis >= 1 and "
                              f"min_loss_scale > 0; got {loss_scale_window}, {hysteresis}, {min_loss_scale}")
        self.loss_scale_window = int(loss_scale_window)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_loss_scale = float(min_loss_scale)
        # DeepSpeed raises when an overflow happens at the minimum scale; by default
        # we floor and keep counting `consecutive_skips`, which the engine reports.
        self.raise_at_min_scale = raise_at_min_scale
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        super().update(overflow)
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_loss_scale and self.raise_at_min_scale:
                    raise ZeroShardError(f"fp16 overflow at the minimum loss scale {self.min_loss_scale:g} "
                                         f"({self.consecutive_skips} consecutive skipped steps): training has "
                                         "diverged or needs bf16/fp32")
                self.scale = max(self.scale / 2.0, self.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.iteration = int(d["iteration"])
        self.last_overflow_iteration = int(d["last_overflow_iteration"])
        self.hysteresis_left = int(d["hysteresis_left"])


class GradScalerRule(LossScaler):
    """torch.amp.GradScaler's scale with its defaults, which DeepSpeed creates for `torch_autocast`
    in float16 (fp32 parameters, fp16 activations): from 2^16, halved at every overflow, doubled
    after `growth_interval` consecutive good steps (torch's `_amp_update_scale_`: the tracker
    counts good steps and restarts at 0 after an overflow or a growth). No minimum, no hysteresis."""

    dynamic = True

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        super().__init__(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def update(self, overflow: bool) -> None:
        super().update(overflow)
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "growth_tracker": self.growth_tracker}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.growth_tracker = int(d.get("growth_tracker", 0))


def make_loss_scaler(policy: LossScalePolicy | None) -> LossScaler:
    """The scaler a precision policy asks for; None (bf16/fp32) gives a fixed scale of 1.0."""
    if policy is None:
        return LossScaler(1.0)
    if policy.rule == "torch":
        return GradScalerRule()
    if not policy.dynamic:
        return LossScaler(policy.static_scale)
    return DynamicLossScaler(initial_scale=2.0**policy.initial_scale_power,
                             loss_scale_window=policy.loss_scale_window, hysteresis=policy.hysteresis,
                             consecutive_hysteresis=policy.consecutive_hysteresis,
                             min_loss_scale=policy.min_loss_scale)
