r"""The observation alone: an agent's score when the max over the skip window is taken away.

`ALE/Pong-v5` differs from `PongNoFrameskip-v4` in more than sticky actions: ALE skips the
frames itself and the agent sees the last raw frame of each skip, not the max over the last
frames, and there are no no-op starts. This plays `gym_eval.py` on a `NoFrameskip` id with one
change, `MaxAndSkipEnv` handing back the last raw frame of its window (what ALE's own frame
skip shows), so the observation's share of the v5 loss is measured apart from the rest. The
summary is `gym_eval.py`'s, its protocol's ``max_pool_frames`` set to False.

    python benchmarks/pong_observation.py --model trained_models/PongNoFrameskip-v4.dat \
        --num-episodes 5 --log-dir /tmp/observation
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gym_eval  # noqa: E402
from checkpoint import env_file_stem, write_json_atomic  # noqa: E402
from cli import parse_eval_args  # noqa: E402
from environment import MaxAndSkipEnv, protocol  # noqa: E402
from utils import UsageError, say_error  # noqa: E402

_max_pooled_step = MaxAndSkipEnv.step


def _last_frame_step(self: MaxAndSkipEnv, action):
    """`MaxAndSkipEnv.step` with the window's last raw frame as the observation."""
    _, reward, terminated, truncated, info = _max_pooled_step(self, action)
    return self._frames[-1], reward, terminated, truncated, info


def main(argv: list[str] | None = None) -> int:
    """Run `gym_eval.py` with the max-pool off; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_eval_args(argv, f"{__doc__.splitlines()[0]} (gym_eval.py's flags)")
        if args.processes != 1:  # the patch below is this process's: spawned ones pool
            raise UsageError(
                f"--processes {args.processes}: pong_observation.py plays in one process; drop it"
            )
        if not protocol(args.env, args.frame_skip, args.max_episode_length).get("max_pool_frames"):
            raise UsageError(
                f"{args.env} has no max over a skip window to take away; give a NoFrameskip "
                "Atari id (e.g. PongNoFrameskip-v4)"
            )
    except UsageError as error:
        say_error("pong_observation.py", error)
        return 2
    path = Path(args.log_dir) / f"{env_file_stem(args.env)}_eval.json"
    earlier = path.stat().st_mtime_ns if path.exists() else None
    MaxAndSkipEnv.step = _last_frame_step
    try:
        code = gym_eval.main(argv)
    finally:
        MaxAndSkipEnv.step = _max_pooled_step
    # An interrupted evaluation's summary too; none if it saved none (an earlier one stays).
    if path.exists() and path.stat().st_mtime_ns != earlier:
        summary = json.loads(path.read_text())
        summary["protocol"]["max_pool_frames"] = False
        summary["observation"] = "the last raw frame of each skip (benchmarks/pong_observation.py)"
        write_json_atomic(summary, path)
    return code


if __name__ == "__main__":
    sys.exit(main())
