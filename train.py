"""The training worker: n-step rollouts on its own model copy, Hogwild updates of the shared one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cli import TrainConfig
from environment import (
    EnvSpec,
    finished_games,
    load_worker_normalizer_state,
    make_env,
    worker_normalizer_state,
)
from model import build_model
from player_util import Agent, NonFiniteError, Rollout
from shared_optim import make_optimizer, scheduled_lr, set_lr
from utils import (
    FIRST_START,
    FatalRunError,
    ProcessContext,
    ProcessStart,
    child_process,
    worker_device,
)


@dataclass
class LossTerms:
    """One rollout's loss and its parts; the parts are detached, for logging."""

    total: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor


def discounted_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    took: torch.Tensor,
    gamma: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step returns and GAE advantages of K rollouts: a reversed scan, without autograd.

    Step t, last to first: ``R = gamma * R + r_t``, ``delta_t = r_t + gamma * V_{t+1} - V_t``,
    ``gae = gae * gamma * tau + delta_t``, from ``R = V_T = bootstrap`` and ``gae = 0``. Steps
    an env did not take (`took` false) pass its values through unchanged. The scan runs in
    numpy on the host, cheaper than small torch ops and the same float32 bits. Returns
    ``(returns, advantages)``, each (T, K), on `values`' device.
    """
    reward, step_taken = rewards.cpu().numpy(), took.cpu().numpy()  # recorded on the host
    # The values and the bootstrap in one copy from the device (the one wait for it here).
    value_and_bootstrap = torch.cat([values, bootstrap.reshape(1, -1)]).cpu().numpy()
    value, ret = value_and_bootstrap[:-1], value_and_bootstrap[-1]
    gamma, tau = np.float32(gamma), np.float32(tau)  # float32 however given (numpy 2 rules)
    next_value = ret
    gae = np.zeros_like(ret)
    returns = np.empty_like(value)
    advantages = np.empty_like(value)
    for t in reversed(range(value.shape[0])):
        step = step_taken[t]
        ret = np.where(step, gamma * ret + reward[t], ret)
        delta = reward[t] + gamma * next_value - value[t]
        gae = np.where(step, gae * gamma * tau + delta, gae)
        next_value = np.where(step, value[t], next_value)
        returns[t], advantages[t] = ret, gae
    both = torch.from_numpy(np.stack([returns, advantages])).to(values.device)  # one copy out
    return both[0], both[1]


def a3c_loss(
    rollout: Rollout, gamma: float, tau: float, entropy_coef: float, value_coef: float
) -> LossTerms:
    """The A3C loss of K envs' rollouts (the sum of each env's own), in two phases.

    The targets come first, without autograd (`discounted_targets`); then the value loss
    ``0.5 * (R_t - V_t)**2`` and the policy loss ``-(log_prob_t * gae_t + entropy_coef *
    entropy_t)``, summed over the steps taken: the original's backward loop on whole tensors.
    Steps an env did not take are dropped with ``torch.where`` before any arithmetic, so a
    stale entry never reaches the loss.
    """
    took = rollout.took.to(rollout.values.device)  # recorded on the host: one copy to a GPU
    zero = torch.zeros((), dtype=rollout.values.dtype, device=rollout.values.device)

    def taken(per_step: torch.Tensor) -> torch.Tensor:
        # Rows not taken become 0 before any arithmetic: a NaN there would turn the zero
        # gradient of a later where() into NaN (0 * NaN) on its way back.
        return torch.where(took, per_step, zero)

    value = taken(rollout.values)
    log_prob = taken(rollout.log_probs)
    entropy = taken(rollout.entropies)
    returns, advantages = discounted_targets(  # on the host's rewards and flags
        rollout.rewards, value.detach(), rollout.bootstrap.detach(), rollout.took, gamma, tau
    )
    value_loss = torch.where(took, 0.5 * (returns - value).pow(2), zero).sum()
    policy_loss = -torch.where(took, log_prob * advantages + entropy_coef * entropy, zero).sum()
    return LossTerms(
        total=policy_loss + value_coef * value_loss,
        policy_loss=policy_loss.detach(),
        value_loss=value_loss.detach(),
        # A sum over the steps taken (the others are 0 already): boolean indexing would wait
        # for the device to learn the result's size.
        entropy=entropy.detach().sum() / took.sum(),
    )


REPORT_SECONDS = 5.0
"""How often a worker sends its averaged statistics to the launcher."""


class TrainStats:
    """One worker's update statistics between two reports.

    Sums stay tensors on the worker's device, so recording an update needs no device sync.
    """

    def __init__(self, model: nn.Module):
        """Group the model's parameters by layer (``conv1``, ``lstm``, ...)."""
        names = [name.split(".")[0] for name, _ in model.named_parameters()]
        self.layers = list(dict.fromkeys(names))
        device = next(model.parameters()).device
        self.layer_index = torch.tensor([self.layers.index(n) for n in names], device=device)
        self.device = device
        self._none = torch.zeros((), device=device)  # the norm of a parameter with no grad
        self._reset()

    def _reset(self) -> None:
        self.updates = 0
        sums = torch.zeros(4, device=self.device).unbind()
        self.policy_loss, self.value_loss, self.entropy, self.grad_norm = sums
        self.layer_norms = torch.zeros(len(self.layers), device=self.device)

    @torch.no_grad()
    def grad_squares(self, model: nn.Module) -> torch.Tensor:
        """Sum of squared gradient entries of each parameter (call after backward).

        As norms squared: ``grad.pow(2)`` would copy every gradient.
        """
        return torch.stack(
            [
                self._none if p.grad is None else torch.linalg.vector_norm(p.grad)
                for p in model.parameters()
            ]
        ).square()

    @torch.no_grad()
    def add(self, terms: LossTerms, squares: torch.Tensor) -> None:
        """Record one update, given its `grad_squares`."""
        per_layer = torch.zeros_like(self.layer_norms).index_add_(0, self.layer_index, squares)
        self.updates += 1
        self.policy_loss += terms.policy_loss
        self.value_loss += terms.value_loss
        self.entropy += terms.entropy
        self.grad_norm += per_layer.sum().sqrt()
        self.layer_norms += per_layer.sqrt()

    def flush(self, rank: int) -> dict[str, float]:
        """Averages since the last flush, as plain floats; then start again."""
        n = max(self.updates, 1)
        out = {
            "rank": rank,
            "updates": self.updates,
            "policy_loss": self.policy_loss.item() / n,
            "value_loss": self.value_loss.item() / n,
            "entropy": self.entropy.item() / n,
            "grad_norm": self.grad_norm.item() / n,
        }
        for layer, norm in zip(self.layers, self.layer_norms.tolist(), strict=True):
            out[f"grad_norm/{layer}"] = norm / n
        self._reset()
        return out


NONFINITE_LIMIT = 10
"""Consecutive updates with a NaN or inf loss or gradient after which a worker gives up."""


def update_is_finite(terms: LossTerms, squares: torch.Tensor) -> bool:
    """The loss and every gradient entry are finite (one device sync).

    A NaN or inf anywhere in a gradient makes its sum of squares non-finite too.
    """
    return bool(torch.isfinite(squares.sum() + terms.total.detach()).item())


def step_size_for(rank: int, num_steps: int, distributed_step_size: list[int]) -> int:
    """The worker's n-step: ``--distributed-step-size`` dealt round-robin, else ``--num-steps``."""
    sizes = distributed_step_size
    return sizes[rank % len(sizes)] if sizes else num_steps


def sync_weights(model: nn.Module, shared_model: nn.Module) -> None:
    """Copy the shared weights into the worker's model, one tensor copy each.

    Cheaper than ``load_state_dict``. From pinned shared memory to a GPU the ``non_blocking``
    copies are asynchronous, ordered before the rollout's first forward on the same stream.
    """
    with torch.no_grad():
        for mine, shared in zip(model.parameters(), shared_model.parameters(), strict=True):
            mine.copy_(shared, non_blocking=True)
        for mine, shared in zip(model.buffers(), shared_model.buffers(), strict=True):
            mine.copy_(shared, non_blocking=True)


def pin_shared_memory(shared_model: nn.Module, device: torch.device) -> list[int]:
    """Page-lock this process's mapping of the shared weights, for asynchronous GPU copies.

    A copy from pageable memory blocks the process; from pinned memory it is one DMA the GPU
    runs meanwhile. Where registration fails, the rest stay unregistered (blocking, correct),
    and the error it leaves pending, which the next kernel launch would report as its own, is
    read away on `device`. Returns the registered addresses, for `unpin_shared_memory`.
    """
    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage()
        for t in shared_model.state_dict().values()
    }
    pinned = []
    for pointer, storage in storages.items():
        if int(cudart.cudaHostRegister(pointer, storage.nbytes(), 0)) != 0:
            # PyTorch binds no call that reads the pending error alone: a tiny kernel reports
            # it (as torch.AcceleratorError) and it is dropped.
            with contextlib.suppress(RuntimeError):
                torch.empty(1, device=device).fill_(0.0)
            break
        pinned.append(pointer)
    return pinned


def unpin_shared_memory(pointers: list[int]) -> None:
    """Undo `pin_shared_memory` once the copies from those pages are done.

    Registrations outlive the tensors: a later shared model mapped at the same addresses in
    this process would be refused.
    """
    if not pointers:
        return
    torch.cuda.synchronize()  # no copy from these pages may still be in flight
    cudart = torch.cuda.cudart()
    for pointer in pointers:
        cudart.cudaHostUnregister(pointer)


@contextlib.contextmanager
def pinned_pages(shared_model: nn.Module, device: torch.device) -> Iterator[None]:
    """The shared weights' pages pinned for a GPU worker's block (`pin_shared_memory`).

    Unpinned however the block ends; after an error, a sticky CUDA error that unpinning
    raises again is dropped, so the error reported stays the block's own.
    """
    pointers = pin_shared_memory(shared_model, device) if device.type == "cuda" else []
    try:
        yield
    except BaseException:
        with contextlib.suppress(RuntimeError):
            unpin_shared_memory(pointers)
        raise
    unpin_shared_memory(pointers)


def ensure_shared_grads(model: nn.Module, shared_model: nn.Module, copy: bool = False) -> None:
    """Give the shared model this worker's current gradients, on every call.

    The optimizer steps the shared parameters, but backward ran on the worker's copy. The
    original handed a gradient over only while the shared one was None, relying on PyTorch 1.x
    zeroing it in place; since ``zero_grad()`` sets None, the shared parameter would keep the
    first gradient forever and training could not learn.

    ``copy=False`` (CPU workers) hands over a reference (``.grad`` is per process).
    ``copy=True`` (GPU workers) copies into a reused, pinned CPU buffer, non-blocking, with
    one synchronisation before returning, so the optimizer never reads a buffer in flight.
    """
    cuda_device = None
    for param, shared_param in zip(model.parameters(), shared_model.parameters(), strict=True):
        grad = param.grad
        if grad is None:
            shared_param.grad = None
            continue
        if not copy:
            shared_param.grad = grad
            continue
        on_cuda = grad.device.type == "cuda"
        buffer = shared_param.grad
        if (
            buffer is None
            or buffer is grad
            or buffer.shape != grad.shape
            or buffer.dtype != grad.dtype
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(grad.shape, dtype=grad.dtype, device="cpu", pin_memory=on_cuda)
            shared_param.grad = buffer
        buffer.copy_(grad, non_blocking=on_cuda)
        if on_cuda:
            cuda_device = grad.device
    if cuda_device is not None:
        torch.cuda.current_stream(cuda_device).synchronize()


def worker_seeds(
    seed: int, rank: int, workers: int, envs: int, start: ProcessStart
) -> tuple[int, list[int]]:
    """Worker `rank`'s torch seed and the seeds of its `envs` envs.

    A fresh run's first start: ``seed + rank``, and env k ``seed + rank + k * workers``; a
    resume or a restart draws afresh (`ProcessStart.seeds`).
    """
    if start.first:
        return seed + rank, [seed + rank + k * workers for k in range(envs)]
    torch_seed, *env_seeds = start.seeds(seed, rank, envs + 1)
    return torch_seed, env_seeds


def _no_lap(phase: str) -> None:
    """The worker loop's lap when nobody times it."""


def run_worker(
    rank: int,
    config: TrainConfig,
    spec: EnvSpec,
    shared_model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: ProcessContext,
    normalizer: dict | None = None,
    on_update: Callable[[LossTerms], None] | None = None,
    lap: Callable[[str], None] = _no_lap,
    start: ProcessStart = FIRST_START,
) -> None:
    """The worker loop, until a stop is asked for or ``--max-steps`` is reached.

    Each rollout: copy the shared weights, play up to n steps, backpropagate on the own copy,
    hand the gradients to the shared model and step the optimizer, without a lock. An update
    with a NaN or inf is skipped and counted; after `NONFINITE_LIMIT` in a row the worker
    raises `FatalRunError`. An `optimizer` of None makes one of the worker's own. `lap(phase)`
    is called as each phase of the loop ends (`benchmarks/bench_step.py` times them).
    """
    # -- setup: device, seeds, envs, own model copy, agent -------------------------------------
    device = worker_device(config.gpu_for(rank))
    seed, seeds = worker_seeds(config.seed, rank, config.workers, config.envs_per_worker, start)
    torch.manual_seed(seed)  # every device's generator, a GPU's too
    # However it ends (a stop, an error, an in-process caller's failing hook), the envs close
    # and the shared pages are unpinned.
    with contextlib.ExitStack() as cleanup:
        envs = []
        for env_seed in seeds:
            env = make_env(spec)
            cleanup.callback(env.close)
            env.action_space.seed(env_seed)
            envs.append(env)
        load_worker_normalizer_state(envs, normalizer)
        if optimizer is None:
            optimizer = make_optimizer(
                shared_model.parameters(), config.optimizer, config.lr, config.amsgrad
            )
        else:
            optimizer.use_slot(rank)  # the shared one: this worker counts its steps in its slot
        spaces = envs[0].observation_space, envs[0].action_space
        model = build_model(*spaces, config.hidden_size).to(device)
        bf16 = config.precision == "bf16"
        if config.fast_path and model.channels_last_suits(device, bf16):
            model.use_channels_last()  # channels_last: 1.6x faster batch-1 forward on CPU
        model.train()
        agent = Agent(
            model, envs, device, reward_scale=config.reward_scale,
            fast_path=config.fast_path, bf16=bf16, bootstrap_truncated=config.bootstrap_truncated,
        )  # fmt: skip
        agent.reset(seeds=seeds)
        num_steps = step_size_for(rank, config.num_steps, config.distributed_step_size)
        stats = TrainStats(model)
        next_report = time.monotonic() + REPORT_SECONDS
        non_finite = 0  # updates skipped in a row

        def send_report() -> None:
            ctx.report(
                "train",
                {
                    **stats.flush(rank),
                    "games": finished_games(envs),
                    "normalizer": worker_normalizer_state(envs),
                },
            )

        # sync_weights' copies from pinned pages run asynchronously
        cleanup.enter_context(pinned_pages(shared_model, device))

        # -- the loop: one rollout, one update --------------------------------------------------
        lap("start")
        while not ctx.should_stop():
            sync_weights(model, shared_model)
            agent.start_rollout()
            lap("sync")

            try:
                agent.play_rollout(num_steps)
                lap("act+env")
                rollout = agent.rollout()
                lap("replay")
                terms = a3c_loss(
                    rollout, config.gamma, config.tau, config.entropy_coef, config.value_coef
                )
                lap("loss")
                model.zero_grad(set_to_none=True)
                terms.total.backward()
                squares = stats.grad_squares(model)
                finite = update_is_finite(terms, squares)
                lap("backward")
            except NonFiniteError:  # the policy itself: nothing was sampled
                finite = False
            ctx.add_steps(agent.steps)

            if not finite:  # skipped: the shared model never sees it
                ctx.count_skipped()
                non_finite += 1
                if non_finite >= NONFINITE_LIMIT:
                    raise FatalRunError(
                        f"{non_finite} updates in a row had a NaN or inf policy, loss or "
                        "gradient (none reached the shared model); lower --lr, or check the "
                        "env's rewards and observations"
                    )
                agent.restart_episodes()  # the LSTM state may hold the NaN too: start afresh
                continue
            non_finite = 0

            ensure_shared_grads(model, shared_model, copy=device.type == "cuda")
            lr = scheduled_lr(config.lr, config.lr_schedule, ctx.total_steps(), config.max_steps)
            set_lr(optimizer, lr)  # --lr-schedule: this worker's copy of the settings
            optimizer.step()
            lap("optimizer")

            stats.add(terms, squares)
            if on_update is not None:
                on_update(terms)
            if time.monotonic() >= next_report:
                send_report()
                next_report = time.monotonic() + REPORT_SECONDS
            lap("report")
        send_report()


def train(
    rank: int,
    config: TrainConfig,
    spec: EnvSpec,
    shared_model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: ProcessContext,
    normalizer: dict | None = None,
    start: ProcessStart = FIRST_START,
) -> None:
    """Process entry point of training worker `rank` (see `run_worker`)."""
    with child_process(f"Train Agent: {rank}", ctx):
        run_worker(rank, config, spec, shared_model, optimizer, ctx, normalizer, start=start)
