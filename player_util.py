"""The acting agent: one model, one env, its LSTM state and the rollout buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from environment import EpisodicLifeEnv, find_wrapper, was_real_done
from fast_path import EncoderTape, act_recorded, replay_features, sequence_from_features
from model import ActorCriticLSTM


class NonFiniteError(ArithmeticError):
    """The policy came out NaN or inf (a broken observation or model); nothing was sampled."""


def sample_actions(logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """One action per row from softmax(logits), with one host/device synchronisation a step.

    Sampling from NaN probabilities fails on CPU and trips a device assert on CUDA, which
    would end the process's CUDA context: a row that is not finite is sampled from a uniform
    stand-in instead, and whether every row was finite comes back in the same transfer as
    the actions (one ``tolist``, not a check and a read). Finite rows are sampled exactly as
    from the logits themselves.

    Returns:
        The actions as a (K, 1) tensor on the logits' device, and as a list.

    Raises:
        NonFiniteError: a row held a NaN or inf (the env must not be stepped).
    """
    logits = logits.detach()
    finite = torch.isfinite(logits).all(1, keepdim=True)
    safe = torch.where(finite, logits, torch.zeros_like(logits))
    actions = F.softmax(safe, dim=1).multinomial(1)
    *taken, all_finite = torch.cat([actions.view(-1), finite.all().view(1).long()]).tolist()
    if not all_finite:
        raise NonFiniteError("the policy's logits hold a NaN or inf")
    return actions, taken


def training_reward(reward: float, clip: bool, scale: float) -> float:
    """The reward the loss sees: clipped to [-1, 1] when `clip` (the original's), times `scale`."""
    return (max(min(reward, 1.0), -1.0) if clip else reward) * scale


def forward(
    model: ActorCriticLSTM, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``model(x, hx, cx)``, with the encoder under bfloat16 autocast when `bf16`.

    The LSTM and the heads always run in float32; without `bf16` this is ``model(x, hx, cx)``
    exactly.
    """
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        features = model.encode(x)
    return model.forward_features(features.float(), hx, cx)


class Agent:
    """Plays one env with one model, on any device, and records a rollout for the loss.

    Training acts on one of two paths, chosen once when the agent is made: the reference path
    (the original's: every step's forward with autograd) or the fast path (`fast_path.py`:
    act without autograd, recording the encoder, then replay the rollout with autograd at
    once). Both give the same losses and gradients; the worker loop does not know which runs.

    Attributes:
        model: the network (the worker's own copy, or the test process's).
        env: the environment it acts in.
        device: where the model, the state and the rollout tensors live.
        state: the current observation as a float32 tensor on `device`.
        hx, cx: LSTM state, shape (1, hidden_size).
        done: the last step ended the episode (a lost life counts in Atari training).
        reward: the last step's training reward: clipped to [-1, 1] when ``clip_rewards``,
            then times ``reward_scale``.
        raw_reward: the last step's reward as the game gave it.
        actions, rewards: the rollout's actions and training rewards since `clear_actions`.
        values, log_probs, entropies: the rollout's loss inputs, complete after
            `prepare_loss_inputs`.
        tape: the fast path's record of the encoder's work (None on the reference path).
        masks: None: every recorded step counts in the loss (see `BatchAgent` for the masks).
    """

    masks: list[torch.Tensor] | None = None

    def __init__(
        self,
        model: nn.Module,
        env: gym.Env,
        device: torch.device | str = "cpu",
        clip_rewards: bool = True,
        reward_scale: float = 1.0,
        fast_path: bool = False,
        bf16: bool = False,
        bootstrap_truncated: bool = False,
    ):
        """Create an agent; call `reset` before acting.

        Args:
            model: the network.
            env: the environment.
            device: where the model lives.
            clip_rewards: clip training rewards to [-1, 1] (the original's rule).
            reward_scale: multiply the (clipped) training rewards by this.
            fast_path: train on the fast path (see `fast_path.py`) instead of the reference.
            bf16: run the encoder under bfloat16 autocast when training (``--precision bf16``).
            bootstrap_truncated: an episode cut by a time limit (truncated, not terminated)
                ends its return with V of its last state instead of 0 (``--bootstrap-truncated``).
        """
        self.model = model
        self.bf16 = bf16
        self.bootstrap_truncated = bootstrap_truncated
        self.truncated = False
        self.env = env
        self.device = torch.device(device)
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self.state = torch.zeros(0)
        self.hx, self.cx = model.initial_state(1, self.device)
        self.done = True
        self.reward = 0.0
        self.raw_reward = 0.0
        self.actions: list[int] = []
        self.rewards: list[float] = []
        self.values: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.tape = EncoderTape() if fast_path else None
        self._rollout_start: tuple[torch.Tensor, torch.Tensor] | None = None
        # The one place the path is chosen: how a training step acts, and how the rollout's
        # loss inputs are completed.
        if fast_path:
            self.action_train = self._act_recording
            self.prepare_loss_inputs = self._replay_rollout
        else:
            self.action_train = self._act_with_autograd
            self.prepare_loss_inputs = self._loss_inputs_ready

    # -- state ------------------------------------------------------------------------------

    def _to_state(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)

    def reset(self, seed: int | None = None) -> None:
        """Reset the env and the LSTM state."""
        obs, _ = self.env.reset(seed=seed)
        self.state = self._to_state(obs)
        self.reset_lstm()
        self.done = False

    def reset_lstm(self) -> None:
        """Zero the LSTM state (at the start of an episode)."""
        self.hx, self.cx = self.model.initial_state(1, self.device)

    def detach_lstm(self) -> None:
        """Cut the graph between rollouts while keeping the LSTM's memory."""
        self.hx = self.hx.detach()
        self.cx = self.cx.detach()

    def start_rollout(self) -> None:
        """A new episode after one ended; otherwise go on with the LSTM state cut from the graph."""
        if self.done:
            self.reset()
        else:
            self.detach_lstm()

    def restart_episodes(self) -> None:
        """Start a fresh episode at the next rollout (after a skipped, non-finite update)."""
        self.done = True

    @property
    def steps(self) -> int:
        """Agent steps recorded in this rollout."""
        return len(self.rewards)

    @property
    def real_done(self) -> bool:
        """The episode ended with a real game over (not just a lost life)."""
        return self.done and was_real_done(self.env)

    # -- acting -----------------------------------------------------------------------------

    def _step_env(self, action: int) -> None:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.state = self._to_state(obs)
        self.done = bool(terminated or truncated)
        self.truncated = bool(truncated and not terminated)
        self.raw_reward = float(reward)
        self.reward = training_reward(self.raw_reward, self.clip_rewards, self.reward_scale)

    def play_rollout(self, num_steps: int) -> int:
        """Take up to `num_steps` training steps, stopping at the end of an episode.

        Returns:
            The steps taken.

        Raises:
            NonFiniteError: the policy came out NaN or inf (the env was not stepped).
        """
        for _ in range(num_steps):
            self.action_train()
            if self.done:
                break
        return len(self.rewards)

    def _act_with_autograd(self) -> Agent:
        """Reference path: sample from the policy, step the env, keep the step's graph.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        value, logits, self.hx, self.cx = forward(
            self.model, self.state.unsqueeze(0), self.hx, self.cx, self.bf16
        )
        action, (taken,) = sample_actions(logits)
        prob = F.softmax(logits, dim=1)
        log_prob = F.log_softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        self.actions.append(taken)
        self._step_env(taken)
        self.values.append(value)
        self.log_probs.append(log_prob.gather(1, action))
        self.rewards.append(self.reward)
        self.entropies.append(entropy)
        return self

    def _loss_inputs_ready(self) -> Agent:
        """Reference path: acting kept every step's graph; nothing left to do."""
        return self

    @torch.no_grad()
    def _act_recording(self) -> Agent:
        """Fast path: sample like the reference path, without autograd, recording the encoder.

        Raises:
            NonFiniteError: the policy is NaN or inf (the env was not stepped).
        """
        assert self.tape is not None
        if self._rollout_start is None:
            self._rollout_start = (self.hx.detach(), self.cx.detach())
        _, logits, self.hx, self.cx = act_recorded(
            self.model, self.state.unsqueeze(0), self.hx, self.cx, self.tape, self.bf16
        )
        _, (taken,) = sample_actions(logits)
        self.actions.append(taken)
        self._step_env(taken)
        self.rewards.append(self.reward)
        return self

    def _replay_rollout(self) -> Agent:
        """Fast path: the rollout's values, log-probabilities and entropies, with autograd.

        The recorded encoder features (`replay_features`, which backpropagates into the conv
        weights without a second forward) go through the LSTM as one sequence from the
        rollout's starting state. That gives the values and policy the per-step forwards gave
        (the weights have not changed since), so the loss and its gradients are those of the
        reference path.
        """
        if self._rollout_start is None or self.tape is None:
            raise RuntimeError("replaying a rollout needs fast-path steps first")
        hx, cx = self._rollout_start
        features = replay_features(self.model, self.tape, self.bf16)
        values, logits = sequence_from_features(self.model, features, hx, cx)
        log_prob = F.log_softmax(logits, dim=1)
        prob = F.softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1)
        actions = torch.tensor(self.actions, device=self.device).unsqueeze(1)
        self.values = list(values.split(1))
        self.log_probs = list(log_prob.gather(1, actions).split(1))
        self.entropies = list(entropy.split(1))
        return self

    @torch.no_grad()
    def action_test(self) -> Agent:
        """Take the greedy (argmax) action and step the env; nothing is recorded."""
        _, logits, self.hx, self.cx = self.model(self.state.unsqueeze(0), self.hx, self.cx)
        self._step_env(int(logits.argmax(1).item()))
        return self

    @torch.no_grad()
    def bootstrap_value(self) -> torch.Tensor:
        """Value of the current state, shape (1, 1), detached.

        0 after the episode's end, as the original computes; with ``bootstrap_truncated``, an
        end by a time limit (truncation) keeps the value of the state it was cut at.
        """
        if self.done and not (self.truncated and self.bootstrap_truncated):
            return torch.zeros(1, 1, device=self.device)
        value, _, _, _ = forward(self.model, self.state.unsqueeze(0), self.hx, self.cx, self.bf16)
        return value

    def clear_actions(self) -> Agent:
        """Empty the rollout buffers (after an update)."""
        self.actions.clear()
        self.rewards.clear()
        self.values = []
        self.log_probs = []
        self.entropies = []
        if self.tape is not None:
            self.tape.clear()
        self._rollout_start = None
        return self


class BatchAgent:
    """Plays K envs in lockstep with one model: one batched forward acts for all of them.

    Each env plays its own rollout as `Agent` does (up to n steps, stopping at the end of its
    episode, its own LSTM state); an env whose episode ended waits, masked out, until the
    others finish the rollout. The K rollouts make one update: the loss is the sum of the K
    rollouts' losses (`train.a3c_loss` with ``masks``). Training only; the test process and
    ``gym_eval.py`` play one env with `Agent`.

    Per-step buffers hold one row per env: ``values[t]``, ``log_probs[t]``, ``rewards[t]`` and
    ``entropies[t]`` are (K, 1) tensors, ``masks[t]`` (K, 1) booleans, true where env k took
    step t.

    Attributes:
        model, envs, device: the network, the K environments, where tensors live.
        state: the current observations, shape (K, *observation_shape).
        hx, cx: LSTM states, shape (K, hidden_size).
        done: per env, its last step ended its episode (it resets at the next rollout).
        actions: per step, the (K,) actions taken (inactive envs' entries are unused).
        tape: the fast path's record of the encoder (None on the reference path).
    """

    def __init__(
        self,
        model: ActorCriticLSTM,
        envs: list[gym.Env],
        device: torch.device | str = "cpu",
        clip_rewards: bool = True,
        reward_scale: float = 1.0,
        fast_path: bool = False,
        bf16: bool = False,
        bootstrap_truncated: bool = False,
    ):
        """Create the agent; call `reset` before acting. Arguments as for `Agent`."""
        self.model = model
        self.envs = envs
        self.bootstrap_truncated = bootstrap_truncated
        # Per env: the step of this rollout at which a time limit cut its episode, or None.
        self.truncated_at: list[int | None] = [None] * len(envs)
        self.device = torch.device(device)
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self.bf16 = bf16
        self.hx, self.cx = model.initial_state(len(envs), self.device)
        self.state = torch.zeros(0)
        self._obs: list[np.ndarray] = []
        self.done = [True] * len(envs)
        self.actions: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.steps = 0
        self.tape = EncoderTape() if fast_path else None
        self._rollout_start: tuple[torch.Tensor, torch.Tensor] | None = None
        if fast_path:
            self._act = self._act_recording
            self.prepare_loss_inputs = self._replay_rollout
        else:
            self._act = self._act_with_autograd
            self.prepare_loss_inputs = self._loss_inputs_ready

    # -- state ------------------------------------------------------------------------------

    def _stack_obs(self) -> None:
        # A new tensor every step: the reference path's graphs keep the old ones.
        self.state = torch.as_tensor(np.stack(self._obs, dtype=np.float32), device=self.device)

    def reset(self, seeds: list[int] | None = None) -> None:
        """Reset every env (env k with ``seeds[k]``) and zero every LSTM state."""
        self._obs = [
            np.asarray(env.reset(seed=None if seeds is None else seeds[k])[0])
            for k, env in enumerate(self.envs)
        ]
        self._stack_obs()
        self.hx, self.cx = self.model.initial_state(len(self.envs), self.device)
        self.done = [False] * len(self.envs)

    def start_rollout(self) -> None:
        """Reset the envs whose episode ended (and their LSTM state); detach the others'."""
        hx, cx = self.hx.detach().clone(), self.cx.detach().clone()
        for k, env in enumerate(self.envs):
            if self.done[k]:
                self._obs[k] = np.asarray(env.reset()[0])
                hx[k] = 0.0
                cx[k] = 0.0
                self.done[k] = False
        self._stack_obs()
        self.hx, self.cx = hx, cx
        self._rollout_start = (hx, cx)

    def restart_episodes(self) -> None:
        """Start fresh episodes in every env at the next rollout (after a skipped update)."""
        self.done = [True] * len(self.envs)

    # -- acting -----------------------------------------------------------------------------

    def play_rollout(self, num_steps: int) -> int:
        """Up to `num_steps` steps in every env, each stopping at the end of its episode.

        Returns:
            The agent steps taken, summed over the envs.

        Raises:
            NonFiniteError: the policy came out NaN or inf (no env was stepped that step).
        """
        for _ in range(num_steps):
            active = [not done for done in self.done]
            if not any(active):
                break
            self._step_envs(self._act(), active)
        return self.steps

    def _step_envs(self, actions: list[int], active: list[bool]) -> None:
        """Step the active envs; record the step's rewards and mask."""
        rewards = [0.0] * len(self.envs)
        for k, env in enumerate(self.envs):
            if not active[k]:
                continue
            obs, reward, terminated, truncated, _ = env.step(actions[k])
            self._obs[k] = np.asarray(obs)
            self.done[k] = bool(terminated or truncated)
            if truncated and not terminated:
                self.truncated_at[k] = len(self.rewards)
            rewards[k] = training_reward(float(reward), self.clip_rewards, self.reward_scale)
        self._stack_obs()
        self.rewards.append(torch.tensor(rewards, device=self.device).unsqueeze(1))
        self.masks.append(torch.tensor(active, device=self.device).unsqueeze(1))
        self.steps += sum(active)

    def _act_with_autograd(self) -> list[int]:
        """Reference path: one batched forward with autograd; keeps the step's graph."""
        value, logits, self.hx, self.cx = forward(
            self.model, self.state, self.hx, self.cx, self.bf16
        )
        action, taken = sample_actions(logits)
        prob = F.softmax(logits, dim=1)
        log_prob = F.log_softmax(logits, dim=1)
        self.actions.append(action.squeeze(1))
        self.values.append(value)
        self.log_probs.append(log_prob.gather(1, action))
        self.entropies.append(-(log_prob * prob).sum(1, keepdim=True))
        return taken

    def _loss_inputs_ready(self) -> BatchAgent:
        return self

    @torch.no_grad()
    def _act_recording(self) -> list[int]:
        """Fast path: one batched forward without autograd, recording the encoder."""
        assert self.tape is not None
        _, logits, self.hx, self.cx = act_recorded(
            self.model, self.state, self.hx, self.cx, self.tape, self.bf16
        )
        action, taken = sample_actions(logits)
        self.actions.append(action.squeeze(1))
        return taken

    def _replay_rollout(self) -> BatchAgent:
        """Fast path: the K rollouts' values, log-probabilities and entropies, with autograd.

        The fused LSTM runs all T steps for every env; the steps an env did not take (after its
        episode ended) compute numbers the masks keep out of the loss, and cannot reach the
        steps before them.
        """
        if self._rollout_start is None or self.tape is None or not len(self.tape):
            raise RuntimeError("replaying a rollout needs fast-path steps first")
        hx, cx = self._rollout_start
        features = replay_features(self.model, self.tape, self.bf16)
        values, logits = sequence_from_features(self.model, features, hx, cx)
        log_prob = F.log_softmax(logits, dim=1)
        prob = F.softmax(logits, dim=1)
        entropy = -(log_prob * prob).sum(1, keepdim=True)
        actions = torch.stack(self.actions).view(-1, 1)  # step-major, as the tape
        batch = len(self.envs)
        self.values = list(values.split(batch))
        self.log_probs = list(log_prob.gather(1, actions).split(batch))
        self.entropies = list(entropy.split(batch))
        return self

    @torch.no_grad()
    def bootstrap_value(self) -> torch.Tensor:
        """Value of each env's current state, 0 where its episode ended; shape (K, 1).

        With ``bootstrap_truncated``, an env whose episode a time limit cut at step t keeps
        V(s_{t+1}) of the state it was cut at: the next step's value of its row (the batch
        forwarded that state with the LSTM state the cut left), or, when the cut came at the
        rollout's last step, the value computed here. Call after `prepare_loss_inputs`.
        """
        value, _, _, _ = forward(self.model, self.state, self.hx, self.cx, self.bf16)
        keep = [not done for done in self.done]
        if self.bootstrap_truncated:
            value = value.clone()
            for k, step in enumerate(self.truncated_at):
                if step is None:
                    continue
                keep[k] = True
                if step + 1 < len(self.values):
                    value[k] = self.values[step + 1][k].detach()
        kept = torch.tensor(keep, device=self.device).unsqueeze(1)
        return torch.where(kept, value, torch.zeros_like(value))

    def clear_actions(self) -> BatchAgent:
        """Empty the rollout buffers (after an update)."""
        for buffer in (self.actions, self.rewards, self.masks):
            buffer.clear()
        self.truncated_at = [None] * len(self.envs)
        self.values, self.log_probs, self.entropies = [], [], []
        self.steps = 0
        if self.tape is not None:
            self.tape.clear()
        self._rollout_start = None
        return self


# ----------------------------------------------------------------------------------------------
# Greedy play: the test process's and gym_eval.py's games
# ----------------------------------------------------------------------------------------------


GAME_OVER, TIME_LIMIT, STALLED, STOPPED = "game over", "time limit", "stalled", "stopped"


@dataclass(frozen=True)
class GameResult:
    """One greedy game.

    Attributes:
        reward: the game's total reward, as the game gave it (not clipped).
        length: agent steps, every life of the game together.
        ending: `GAME_OVER`; `TIME_LIMIT` (``--max-episode-length``); `STALLED` (``--stall-steps``
            steps in a row without a reward, e.g. Breakout waiting for a FIRE the agent never
            presses); `STOPPED` (the caller asked to stop mid-game).
        steps_without_reward: steps since the last non-zero reward when the game ended.
    """

    reward: float
    length: int
    ending: str
    steps_without_reward: int

    def note(self) -> str:
        """What the log says after the reward when the game did not end in a game over."""
        if self.ending == STALLED:
            return f", stalled: no reward in {self.steps_without_reward} steps"
        if self.ending == TIME_LIMIT:
            return (
                f", cut by the time limit (no reward in the last {self.steps_without_reward} steps)"
            )
        return ""


class GreedyPlayer:
    """Plays whole games with the argmax action: what the test process and gym_eval.py score.

    A lost life goes on with the same game (the LSTM state starts afresh, as in training);
    the game ends at a real game over, at the time limit, after ``stall_steps`` steps in a row
    without a reward, or when `should_stop` says so. After a game that ended early the next
    one starts from a real reset, not from the lost-life reset.
    """

    def __init__(self, model: nn.Module, env: gym.Env, device: torch.device | str = "cpu"):
        """A player for `model` (on `device`) in `env`."""
        self.model = model
        self.env = env
        self.device = torch.device(device)

    def _state(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device).unsqueeze(0)

    @torch.no_grad()
    def play_game(
        self,
        seed: int | None = None,
        stall_steps: int = 0,
        on_frame: Callable[[np.ndarray], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GameResult:
        """Play one game from a real reset.

        Args:
            seed: seeds the env's reset (the first game of a run, for reproducibility).
            stall_steps: end the game after this many steps in a row without a reward
                (0: only the game's own end and the time limit end it).
            on_frame: gets the rendered screen before every action (the env must render
                ``rgb_array``).
            should_stop: asked before every step; True ends the game as `STOPPED`.
        """
        force_real_reset(self.env)
        obs, _ = self.env.reset(seed=seed)
        state = self._state(obs)
        hx, cx = self.model.initial_state(1, self.device)
        reward, length, since_reward = 0.0, 0, 0
        while True:
            if should_stop is not None and should_stop():
                force_real_reset(self.env)
                return GameResult(reward, length, STOPPED, since_reward)
            if on_frame is not None:
                on_frame(self.env.render())
            _, logits, hx, cx = self.model(state, hx, cx)
            obs, step_reward, terminated, truncated, _ = self.env.step(int(logits.argmax(1)))
            state = self._state(obs)
            reward += float(step_reward)
            length += 1
            since_reward = 0 if step_reward != 0 else since_reward + 1
            if terminated or truncated:
                if was_real_done(self.env):
                    ending = GAME_OVER if terminated and not truncated else TIME_LIMIT
                    return GameResult(reward, length, ending, since_reward)
                obs, _ = self.env.reset()  # a lost life: the same game goes on
                state = self._state(obs)
                hx, cx = self.model.initial_state(1, self.device)
            if stall_steps and since_reward >= stall_steps:
                force_real_reset(self.env)
                return GameResult(reward, length, STALLED, since_reward)


def force_real_reset(env: gym.Env) -> None:
    """Make the env's next reset a real one, also mid-game (Atari's lost-life reset is not)."""
    life = find_wrapper(env, EpisodicLifeEnv)
    if life is not None:
        life.was_real_done = True
