"""Registration of specrl's env ids with Gymnasium (lazy entry points: nothing heavy imported)."""

from __future__ import annotations

ENV_IDS = {
    "specrl/SpecDecode-v0": "specrl.envs.live:SpecDecodeEnv",
    "specrl/SpecReplay-v0": "specrl.envs.replay:SpecReplayEnv",
}
MAX_EPISODE_STEPS = 20000


def register_envs() -> None:
    from gymnasium.envs.registration import register, registry

    for env_id, entry_point in ENV_IDS.items():
        if env_id not in registry:
            register(id=env_id, entry_point=entry_point, max_episode_steps=MAX_EPISODE_STEPS)
