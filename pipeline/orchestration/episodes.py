"""Rollouts in memory, without Prefect or the store (`mtrl eval`, the embedded model's build, tests,
notebooks): the turns of one iteration's rollouts, played turn by turn with the stages' own
functions, and scored."""

from __future__ import annotations

from typing import Any

import datasets

from schemas.config import RunConfig
from schemas.token_stream import continue_streams
from stages.assign_rewards import RewardSettings, assign_rewards
from stages.execute_tools import ExecuteSettings, execute_tools
from stages.generate_rollouts import GenerateSettings, first_turn, generate_rollouts, next_turn
from stages.generate_rollouts.engine import GenerationEngine


def run_episodes(engine: GenerationEngine, tokenizer: Any, config: RunConfig, iteration: int = 0) -> datasets.Dataset:
    """All turns of one iteration's rollouts, scored: the assign-rewards dataset, in memory."""
    generating, executing = GenerateSettings.resolve(config), ExecuteSettings.resolve(config)
    environments, tools = executing.tasks.environments(), executing.tasks.tools()
    pending, streams, played = first_turn(tokenizer, generating, iteration), {}, []
    for turn in range(generating.tasks.longest_turn_limit()):
        generated, _ = generate_rollouts(
            engine, tokenizer, generating, pending, iteration=iteration, turn=turn, policy_version="in-memory"
        )
        played.append(execute_tools(generated, tokenizer, environments, tools, executing))
        streams = continue_streams(streams, played[-1])
        pending = next_turn(tokenizer, generating, played[-1], streams)
        if not pending:
            break
    rewarding = RewardSettings.resolve(config)
    return assign_rewards(datasets.concatenate_datasets(played), rewarding.tasks.environments(), rewarding)
