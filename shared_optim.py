"""Optimizers whose statistics live in shared memory, for Hogwild training.

All state is created in ``__init__``, not on the first step, so `share_memory()` can share it
before the workers start; they then update the same statistics without locks. The arithmetic
follows ``torch.optim.Adam`` / ``torch.optim.RMSprop`` operation for operation (the original's
SharedAdam adds eps before the bias correction: docs/differences.md).

Each worker counts its steps in its own slot of a shared vector, and an update uses their sum:
``step += 1`` on one shared number is a read-modify-write race that loses steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import optim

Params = Iterable[torch.Tensor] | Iterable[dict]


def _same_setting(a: Any, b: Any) -> bool:
    """Equal settings; a tuple (betas) may come back from a file as a list."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


LR_SCHEDULES = ("constant", "linear")


def scheduled_lr(lr: float, schedule: str, steps: int, max_steps: int) -> float:
    """The learning rate after `steps` agent steps (all workers together) under `schedule`.

    ``linear`` falls from `lr` at step 0 to 0 at `max_steps` (the A3C paper's annealing), so
    the run ends on a settled policy.
    """
    if schedule == "constant":
        return lr
    if schedule != "linear":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; pick one of {LR_SCHEDULES}")
    if max_steps <= 0:
        raise ValueError("the linear learning-rate schedule needs a step budget (max_steps > 0)")
    return lr * max(0.0, 1.0 - steps / max_steps)


def set_lr(optimizer: optim.Optimizer, lr: float) -> None:
    """Use `lr` for the next steps (this process's copy of the settings; the statistics stay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


SECOND_MOMENTS = ("exp_avg_sq", "square_avg")
"""State names of averages of squared gradients (never negative)."""


class _SharedOptimizer(optim.Optimizer):
    """Base class: eager state creation, `share_memory`, and the step count kept in slots.

    `step_counts` holds each worker's steps (float64: exact to 2**53); `slot` is the one this
    process counts in (`use_slot`).
    """

    def _init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _create_state(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"expected slots >= 1, got {slots}")
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = self._init_state(param, group)
        self.step_counts = torch.zeros(slots, dtype=torch.float64)
        self.slot = 0

    def use_slot(self, slot: int) -> None:
        """Count this process's steps in `slot` (a worker's rank; no other process may use it)."""
        if not 0 <= slot < len(self.step_counts):
            raise ValueError(f"expected slot in 0..{len(self.step_counts) - 1}, got {slot}")
        self.slot = slot

    def steps_taken(self) -> int:
        """Updates applied by every process so far (a resumed optimizer's included)."""
        return int(self.step_counts.sum())

    def _decays(self, group: dict) -> dict[str, float]:
        raise NotImplementedError

    def moving_averages(self) -> list[tuple[torch.Tensor, float, bool]]:
        """The statistics a step moves as ``avg = decay * avg + new``, in a fixed order.

        Each is ``(tensor, decay, is_second_moment)``: every state tensor but the step count and
        AMSGrad's maximum (each process keeps its own). A cluster exchanges these.
        """
        averages = []
        for group in self.param_groups:
            decays = self._decays(group)
            for param in group["params"]:
                state = self.state[param]
                for name in sorted(state):
                    if name in decays:
                        averages.append((state[name], decays[name], name in SECOND_MOMENTS))
        return averages

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults, state and param_groups; a worker
        # needs the shared slots too.
        return {**super().__getstate__(), "step_counts": self.step_counts, "slot": self.slot}

    def share_memory(self) -> None:
        """Move every state tensor to shared memory (call before starting workers)."""
        self.step_counts.share_memory_()
        for state in self.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.share_memory_()

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: dict,
        step: float,
    ) -> None:
        """Apply one update to `param`; `step` counts this update (1 for the first)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> None:
        """Apply one update with the gradients currently on the parameters."""
        self.step_counts[self.slot] += 1
        # One read for the whole update: other workers count on meanwhile (Hogwild).
        step = float(self.step_counts.sum())
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["step"].fill_(step)  # torch's layout, for state_dict and readers
                self._update(param, param.grad, state, group, step)

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's layout, every ``step`` the count of all workers' updates."""
        total = float(self.step_counts.sum())
        for state in self.state.values():
            state["step"].fill_(total)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load statistics, keeping them in shared memory if they were before.

        The saved step count goes to slot 0; the workers count on from it.
        """
        was_shared = self.step_counts.is_shared()
        super().load_state_dict(state_dict)
        steps = [float(s["step"]) for s in self.state.values() if "step" in s]
        self.step_counts.zero_()
        self.step_counts[0] = max(steps, default=0.0)
        if was_shared:
            self.share_memory()

    def load_statistics(self, state_dict: dict) -> dict[str, tuple[Any, Any]]:
        """Load saved statistics but keep this optimizer's own settings (lr, betas, eps, ...).

        `load_state_dict` restores the saved settings too, so a resume with a new ``--lr`` would
        go on with the old one. Returns name -> (saved, kept) for each setting that differs.
        """
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self.load_state_dict(state_dict)
        changed: dict[str, tuple[Any, Any]] = {}
        for group, own in zip(self.param_groups, settings, strict=True):
            for key, value in own.items():
                if key in group and not _same_setting(group[key], value):
                    changed[key] = (group[key], value)
                group[key] = value
        return changed


class SharedRMSprop(_SharedOptimizer):
    """RMSprop with shared statistics (defaults as in the original A3G: eps 0.1)."""

    def __init__(
        self,
        params: Params,
        lr: float = 7e-4,
        alpha: float = 0.99,
        eps: float = 0.1,
        centered: bool = False,
        slots: int = 1,
    ):
        """Create the optimizer and its (not yet shared) state, a step slot per process."""
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, centered=centered))
        self._create_state(slots)

    def _init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.zeros((), dtype=torch.float64),  # exact past 2**24 updates
            "square_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(param)
        return state

    def _decays(self, group: dict) -> dict[str, float]:
        alpha = group["alpha"]
        return {"square_avg": alpha, "grad_avg": alpha}

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: dict,
        step: float,
    ) -> None:
        lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
        square_avg = state["square_avg"]
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        if group["centered"]:
            grad_avg = state["grad_avg"]
            grad_avg.lerp_(grad, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        param.addcdiv_(grad, avg.add_(eps), value=-lr)


class SharedAdam(_SharedOptimizer):
    """Adam (optionally AMSGrad) with shared statistics (defaults as in the original: eps 1e-3)."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-3,
        amsgrad: bool = False,
        slots: int = 1,
    ):
        """Create the optimizer and its (not yet shared) state, a step slot per process."""
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, amsgrad=amsgrad))
        self._create_state(slots)

    def _init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.zeros((), dtype=torch.float64),  # exact past 2**24 updates
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _decays(self, group: dict) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return {"exp_avg": beta1, "exp_avg_sq": beta2}

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: dict,
        step: float,
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if group["amsgrad"]:
            max_exp_avg_sq = state["max_exp_avg_sq"]
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            second_moment = max_exp_avg_sq
        else:
            second_moment = exp_avg_sq
        # In place after the sqrt: torch.optim.Adam's bits with one parameter-sized temporary.
        denom = second_moment.sqrt().div_(bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def make_optimizer(
    params: Iterable[torch.Tensor], optimizer: str, lr: float, amsgrad: bool, slots: int = 1
) -> torch.optim.Optimizer:
    """The optimizer named by ``--optimizer`` with ``--lr`` (and ``--amsgrad`` for Adam)."""
    if optimizer == "RMSprop":
        return SharedRMSprop(params, lr=lr, slots=slots)
    return SharedAdam(params, lr=lr, amsgrad=amsgrad, slots=slots)
