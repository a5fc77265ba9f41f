"""Golden numbers: one update's losses and gradients on fixed rollouts, saved once as numbers.

Any rewrite of the acting agent or the loss must reproduce them to float precision: K=1 and
K=3, the fast and the reference path, on Pong from fixed seeds, with an episode ending
mid-rollout (an 11-step time limit cuts the one env, or the middle one of three, 3 steps into
the second rollout). The numbers in ``golden_losses.json`` were written by this file's `main`
from the code of 2026-11-23, before one `Agent` replaced the one-env and the K-env agents; run
``python tests/test_golden.py --write`` only when a change of the numbers is intended.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import gymnasium as gym
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from environment import EnvSpec, env_config, make_env, read_config  # noqa: E402
from model import build_model  # noqa: E402
from player_util import Agent  # noqa: E402
from train import a3c_loss  # noqa: E402

GOLDEN = Path(__file__).with_name("golden_losses.json")
CASES = [(envs, fast) for envs in (1, 3) for fast in (False, True)]
STEPS = 8
GAMMA, TAU, ENTROPY_COEF, VALUE_COEF = 0.99, 1.0, 0.01, 0.5


def case_name(envs: int, fast: bool) -> str:
    return f"k{envs}_{'fast' if fast else 'reference'}"


def golden_update(envs: int, fast: bool) -> dict[str, object]:
    """Two rollouts and one update each, on fixed seeds; the second update's numbers.

    The first rollout starts the episodes; in the second, an episode ends mid-rollout: an
    11-step time limit cuts the one env, or env 1 of three, after its 3rd step.
    """
    env_id = "PongNoFrameskip-v4"
    conf = env_config(read_config(ROOT / "config.json"), env_id)
    games = [make_env(EnvSpec(env_id, conf)) for _ in range(envs)]
    cut = 0 if envs == 1 else 1
    games[cut] = gym.wrappers.TimeLimit(games[cut], 11 if envs == 1 else STEPS + 3)
    torch.manual_seed(0)
    model = build_model(games[0].observation_space, games[0].action_space, 32)
    if fast:
        model.use_channels_last()
    agent = Agent(model, games, fast_path=fast)
    agent.reset(seeds=[3 + k for k in range(envs)])
    torch.manual_seed(42)
    result: dict[str, object] = {}
    for _ in range(2):
        agent.start_rollout()
        taken = agent.play_rollout(STEPS)
        terms = a3c_loss(agent.rollout(), GAMMA, TAU, ENTROPY_COEF, VALUE_COEF)
        model.zero_grad(set_to_none=True)
        terms.total.backward()
        grads = {name: p.grad.double() for name, p in model.named_parameters()}
        result = {
            "steps": taken,
            "total": terms.total.item(),
            "policy_loss": terms.policy_loss.item(),
            "value_loss": terms.value_loss.item(),
            "entropy": terms.entropy.item(),
            "grad_sum": {name: g.sum().item() for name, g in grads.items()},
            "grad_sq": {name: g.pow(2).sum().item() for name, g in grads.items()},
            "grad_head": {name: g.flatten()[:4].tolist() for name, g in grads.items()},
        }
    return result


@pytest.mark.parametrize(("envs", "fast"), CASES, ids=[case_name(*c) for c in CASES])
def test_the_update_reproduces_the_golden_numbers(envs, fast):
    golden = json.loads(GOLDEN.read_text())[case_name(envs, fast)]
    got = golden_update(envs, fast)
    assert got["steps"] == golden["steps"]
    for key in ("total", "policy_loss", "value_loss", "entropy"):
        assert got[key] == pytest.approx(golden[key], rel=1e-5, abs=1e-7), key
    for name, square in golden["grad_sq"].items():
        # Float rounding scales with the gradient's size, not with an entry or a sum (the
        # actor's gradient sums to 0 up to rounding, ~1e-8), and moves with the thread count:
        # one thread against two moved sums by up to 1e-5 of the gradient's norm (measured).
        scale = 1e-4 * math.sqrt(square) + 1e-9
        assert got["grad_sq"][name] == pytest.approx(square, rel=1e-4), name
        assert got["grad_sum"][name] == pytest.approx(golden["grad_sum"][name], abs=scale), name
        assert got["grad_head"][name] == pytest.approx(golden["grad_head"][name], abs=scale), name


def main() -> None:
    """Write the golden file (only when a change of the numbers is intended)."""
    if "--write" not in sys.argv:
        raise SystemExit("usage: python tests/test_golden.py --write")
    numbers = {case_name(envs, fast): golden_update(envs, fast) for envs, fast in CASES}
    GOLDEN.write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
