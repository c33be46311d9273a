"""The audit: checks a stage's dataset before anything trains on it.

A silent misalignment between tokens, logprobs and advantages wrecks a run without an error,
so ppo-update refuses data that fails any of these checks, with a message naming the rollout,
the turn and what is wrong (also available as `mtrl audit STAGE/VERSION`):

  contiguous     each rollout's turns are 0..n-1, and only its last turn has a stop reason
  stream         stream_offset of every turn equals the tokens of the turns before it; turn 0's
                 context is the chat-template rendering of the task's first messages; later
                 contexts are the generation prompt; the observation text decodes from its tokens
  lengths        one logprob (and advantage, return, value, ref logprob) per completion token
  logprobs       finite and <= 0
  advantages     finite; failed rollouts carry none
  failed         at most max_failed_fraction of the rollouts failed (an infrastructure failure
                 each: a crashed tool, a raising environment)
  trainable      at least one completion token (prompts that all overflow the context would
                 otherwise train a no-op update and report success)
  policy         the policy version that generated the rows is in the store
  rescore        a sample of rollouts re-scored by the stored policy agrees with the stored
                 logprobs within a tolerance
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np

from pipeline.store.lineage import generating_policy, load_turns
from pipeline.store.versions import Store
from runtime.passes import PassCounts, counting_passes
from schemas.config import RunConfig
from schemas.features import GENERATE_ROLLOUTS, dataset_from_rows, is_agent_rollout
from schemas.stage import POLICY
from schemas.token_stream import Rollout, generation_prompt_ids, prompt_token_ids, rollouts
from stages.environments import Environment
from stages.policy.loading import load_model, load_tokenizer, rescore_tolerance
from stages.policy.scoring import score_rollouts
from stages.registry import Tasks, tool_schemas


class AuditError(ValueError):
    """A dataset that must not be trained on."""


@dataclass
class AuditReport:
    checks: dict[str, int] = field(default_factory=dict)  # check -> problems found
    problems: list[str] = field(default_factory=list)  # the first problems, precisely
    rescore_max_abs_diff: float | None = None
    rescore_tolerance: float | None = None
    passes: PassCounts = field(default_factory=dict)  # the re-score's forward passes

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, problem: str | None = None) -> None:
        self.checks.setdefault(check, 0)
        if problem is not None:
            self.checks[check] += 1
            if len(self.problems) < 20:
                self.problems.append(f"{check}: {problem}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checks": self.checks,
            "problems": self.problems,
            "rescore_max_abs_diff": self.rescore_max_abs_diff,
            "rescore_tolerance": self.rescore_tolerance,
            "passes": self.passes,
        }


def audit(
    turns: datasets.Dataset,
    store: Store,
    tokenizer: Any,
    *,
    enable_thinking: bool,
    environments: dict[str, Environment],
    tools: dict[str, Any],
    rescore_fraction: float = 0.1,
    rescore_tolerance: float = 1e-3,
    temperature: float = 1.0,
    seed: int = 0,
    max_failed_fraction: float = 1.0,
) -> AuditReport:
    """Check a generate/execute/assign/compute dataset (columns it lacks are not checked).
    `environments` and `tools` (stages.registry.Tasks: environments(), tools()) render each rollout's
    prompt, which its first context must be."""
    report = AuditReport(rescore_tolerance=rescore_tolerance)
    columns = set(turns.column_names)
    all_rollouts = rollouts(turns)
    prompt_tokens = generation_prompt_ids(tokenizer, enable_thinking)
    for rollout in all_rollouts:
        rows = [turns[row] for row in rollout.rows]
        where = f"rollout {rollout.rollout_id}"
        turns_seen = rollout.turns
        report.add("contiguous", None if turns_seen == list(range(len(rows))) else f"{where} has turns {turns_seen}")
        if "stop_reason" in columns:
            stops = [row["stop_reason"] is not None for row in rows]
            if any(stops[:-1]):
                report.add(
                    "contiguous", f"{where}: turn {turns_seen[stops.index(True)]} has a stop reason but is not the last"
                )
        agent = is_agent_rollout(rows[0])
        if len(rollout.segment_starts) > 1 and not agent:
            report.add("stream", f"{where}: turn {rows[rollout.segment_starts[1]]['turn']} has stream_offset 0")
        for position, row in enumerate(rows):
            at = f"{where} turn {row['turn']}"
            offset = rollout.context_spans[position][0] - rollout.segment_start(position)
            report.add(
                "stream",
                None
                if row["stream_offset"] == offset
                else f"{at}: stream_offset {row['stream_offset']}, but the turns before it hold {offset} tokens",
            )
            if agent and row["stream_offset"] == 0:
                pass  # an agent's segment starts with its own messages rendered, no task prompt to compare
            elif row["turn"] == 0:
                environment = environments.get(row["task"])
                if environment is not None:
                    messages = environment.reset(json.loads(row["task_payload"]))
                    schemas = tool_schemas(environment, tools)
                    expected = prompt_token_ids(tokenizer, messages, schemas, enable_thinking)
                    report.add(
                        "stream",
                        None
                        if row["context_token_ids"] == expected
                        else f"{at}: the context is not the rendered prompt of its task",
                    )
            elif row["context_token_ids"] != prompt_tokens:
                report.add("stream", f"{at}: the context is not the generation prompt")
            if "observation" in columns and row["observation"] != tokenizer.decode(row["observation_token_ids"]):
                report.add("stream", f"{at}: the observation text does not decode from its tokens")

            n = len(row["completion_token_ids"])
            for name in ("completion_logprobs", "advantages", "returns"):
                if name in columns and len(row[name]) != n:
                    report.add("lengths", f"{at}: {len(row[name])} {name} for {n} completion tokens")
            for name in ("values", "ref_logprobs"):
                if name in columns and row[name] and len(row[name]) != n:
                    report.add("lengths", f"{at}: {len(row[name])} {name} for {n} completion tokens")
            report.add("lengths")
            logprobs = np.asarray(row["completion_logprobs"], dtype=np.float64)
            bad = np.flatnonzero(~np.isfinite(logprobs) | (logprobs > 0))
            report.add(
                "logprobs",
                None
                if not bad.size
                else f"{at}: logprob {logprobs[bad[0]]} at completion token {bad[0]} (must be finite and <= 0)",
            )
            if "advantages" in columns:
                advantages = np.asarray(row["advantages"], dtype=np.float64)
                bad = np.flatnonzero(~np.isfinite(advantages))
                report.add(
                    "advantages",
                    None if not bad.size else f"{at}: advantage {advantages[bad[0]]} at completion token {bad[0]}",
                )
                if row.get("failed") and np.any(advantages != 0):
                    report.add("advantages", f"{at}: a failed rollout carries non-zero advantages")
    failed = [rollout for rollout in all_rollouts if rollout.failed]
    share = len(failed) / max(1, len(all_rollouts))
    report.add(
        "failed",
        None
        if share <= max_failed_fraction
        else f"{len(failed)} of {len(all_rollouts)} rollouts failed ({share:.0%} > max_failed_fraction "
        f"{max_failed_fraction:g}); the first: {_failure_of(turns, failed[0])}",
    )
    generated = sum(len(ids) for ids in turns["completion_token_ids"])
    stop_reasons = Counter(turns["stop_reason"]) if "stop_reason" in columns else Counter()
    stop_reasons.pop(None, None)
    report.add(
        "trainable",
        None
        if generated or not all_rollouts
        else f"not one completion token in {len(all_rollouts)} rollouts, so ppo-update would train on nothing "
        f"(stop reasons: {', '.join(f'{reason} {n}' for reason, n in stop_reasons.most_common()) or 'none'}); "
        "a context_overflow means the prompts do not fit generation.max_context_tokens",
    )
    for policy in sorted(set(turns["policy_version"])):
        report.add("policy", None if store.exists(POLICY, policy) else f"policy {policy} is not in the store")

    if rescore_fraction > 0 and report.checks.get("policy") == 0 and all_rollouts:
        with counting_passes() as report.passes:
            report.rescore_max_abs_diff = _rescore(
                turns, store, all_rollouts, rescore_fraction, temperature, seed, tokenizer.pad_token_id
            )
        report.add(
            "rescore",
            None
            if report.rescore_max_abs_diff <= rescore_tolerance
            else f"stored logprobs differ from the stored policy's by up to {report.rescore_max_abs_diff:.3g} "
            f"(tolerance {rescore_tolerance:g})",
        )
    return report


def _failure_of(turns: datasets.Dataset, rollout: Rollout) -> str:
    messages = [message for message in turns.select(rollout.rows)["failure"] if message]
    return f"rollout {rollout.rollout_id}: {messages[0] if messages else 'no message'}"


def _rescore(
    turns: datasets.Dataset,
    store: Store,
    all_rollouts: list[Rollout],
    fraction: float,
    temperature: float,
    seed: int,
    pad_token_id: int,
) -> float:
    """Max |stored - recomputed| logprob over a seeded sample of rollouts of each policy."""
    by_id = {rollout.rollout_id: rollout for rollout in all_rollouts}
    rng = random.Random(seed)
    chosen = sorted(rng.sample(sorted(by_id), max(1, math.ceil(fraction * len(by_id)))))
    rows = [row for rollout_id in chosen for row in by_id[rollout_id].rows]
    sample = turns.select(rows)
    worst = 0.0
    for policy in sorted(set(sample["policy_version"])):
        part = sample.select([i for i, v in enumerate(sample["policy_version"]) if v == policy])
        model = load_model(store.policy_dir(policy), "float32", "cpu")
        recomputed, _ = score_rollouts(
            model,
            part,
            temperature=temperature,
            pad_token_id=pad_token_id,
            chunk_tokens=1024,
            batch_rollouts=8,
            kind="audit_rescore",
        )
        for stored, fresh in zip(part["completion_logprobs"], recomputed):
            if stored and len(stored) == len(fresh):  # a length mismatch is the lengths check's
                worst = max(worst, float(np.max(np.abs(np.asarray(stored) - np.asarray(fresh)))))
    return worst


def turns_with_history(store: Store, stage: str, version: str) -> datasets.Dataset:
    """A version's rows, preceded for a one-turn version (generate-rollouts, execute-tools) by
    the earlier turns of its rollouts: a later turn's stream offsets and logprobs are only
    defined after them. The rows of a turn not yet executed get an empty observation."""
    turns = store.load(stage, version)
    previous = version if stage == "execute-tools" else store.manifest(stage, version).parents.get("execute-tools")
    if stage not in ("generate-rollouts", "execute-tools") or previous is None:
        return turns
    history = load_turns(store, previous)
    if stage == "generate-rollouts":
        columns = [*GENERATE_ROLLOUTS, "observation", "observation_token_ids"]
        history = history.select_columns(columns)
        pending = [{**row, "observation": "", "observation_token_ids": []} for row in turns.to_list()]
        history = datasets.concatenate_datasets([history, dataset_from_rows(pending, history.features)])
    rollout_ids = set(turns["rollout_id"])
    return history.select([i for i, rollout_id in enumerate(history["rollout_id"]) if rollout_id in rollout_ids])


def audit_stored(store: Store, stage: str, version: str, config: RunConfig, seed: int = 0) -> AuditReport:
    """Audit a stored version of turns (with the earlier turns of a one-turn version) under a
    run's settings: its templates, tools, dtype and `audit` section."""
    turns = turns_with_history(store, stage, version)  # a later turn is checked after the earlier ones
    policy_dir = store.policy_dir(generating_policy(store, stage, version))
    tasks = Tasks.resolve(config)
    return audit(
        turns,
        store,
        load_tokenizer(str(policy_dir)),
        enable_thinking=config.generation.enable_thinking,
        environments=tasks.environments(),
        tools=tasks.tools(),
        rescore_fraction=config.audit.rescore_fraction,
        rescore_tolerance=rescore_tolerance(config.audit.tolerance, config.model.dtype),
        temperature=config.generation.temperature,
        seed=seed,
        max_failed_fraction=config.audit.max_failed_fraction,
    )


def audit_before_training(store: Store, version: str, config: RunConfig, seed: int) -> AuditReport:
    """The gate in front of ppo-update: audit compute-advantages/`version` with the run's settings;
    a dataset that fails raises AuditError and is never trained on."""
    report = audit_stored(store, "compute-advantages", version, config, seed)
    if not report.ok:
        raise AuditError(f"compute-advantages/{version} fails the audit: " + "; ".join(report.problems))
    return report
