"""What an RL run's versions say about each other, read from their manifests.

The store (store.py) knows versions, parents and files; these queries know what the stages
mean: an iteration's turns are a chain of execute-tools versions, a policy was trained by a
ppo-update from the previous policy (on rollouts of an older one with ppo.max_staleness > 0),
the first policy is the KL reference, and each stage records the part of the run config its
output depends on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import datasets

from pipeline.store.versions import Store
from schemas.manifest import Manifest, StoreError
from schemas.stage import POLICY

REFERENCE = f"{POLICY}#reference"  # the input holding the KL's reference policy


def turns_of(store: Store, tools_version: str) -> list[str]:
    """The execute-tools versions of every turn of an iteration up to this one, oldest first
    (each turn's generate-rollouts version names the previous turn's execute-tools version)."""
    chain: list[str] = []
    current: str | None = tools_version
    while current is not None:
        chain.append(current)
        generated = store.manifest("execute-tools", current).parents["generate-rollouts"]
        current = store.manifest("generate-rollouts", generated).parents.get("execute-tools")
    return chain[::-1]


def load_turns(store: Store, tools_version: str) -> datasets.Dataset:
    """Every turn of an iteration up to this execute-tools version, in one dataset."""
    return datasets.concatenate_datasets([store.load("execute-tools", v) for v in turns_of(store, tools_version)])


def latest_policy(store: Store) -> str | None:
    """The newest policy of the store (the highest iteration, then the newest write)."""
    policies = store.versions(POLICY)
    if not policies:
        return None
    newest = max(policies, key=lambda m: (-1 if m.iteration is None else m.iteration, m.created_at))
    return newest.version


def policy_chain(store: Store, policy_version: str) -> Iterator[Manifest]:
    """A policy and the policies it was trained from, newest first, back to the starting policy
    (each policy's ppo-update names the policy it trained); each manifest read when reached."""
    version: str | None = policy_version
    while version is not None:
        manifest = store.manifest(POLICY, version)
        yield manifest
        update = manifest.parents.get("ppo-update")
        version = store.manifest("ppo-update", update).parents[POLICY] if update else None


def policies_before(store: Store, policy_version: str, updates: int) -> list[str]:
    """This policy, then the policies 1, 2, ... `updates` ppo-updates before it in its lineage (the
    starting policy for those the lineage is too short for): with ppo.max_staleness K, iteration i's
    rollouts come from the policy K updates before the one iteration i trains, i.e. from policy
    max(0, i - K), and those of iteration i + 1, made beside i's update, from the one K - 1 before."""
    chain = [manifest.version for manifest in itertools.islice(policy_chain(store, policy_version), updates + 1)]
    return chain + [chain[-1]] * (updates + 1 - len(chain))


def staleness(store: Store, generating: str, trained: str) -> int:
    """How many updates the policy that generated rollouts is behind the policy trained on them
    (ppo.max_staleness bounds it)."""
    return store.manifest(POLICY, trained).iteration - store.manifest(POLICY, generating).iteration


def reference_policy(store: Store, policy_version: str) -> str:
    """The policy RL started from in a policy's lineage, the KL reference: the first one not
    trained by ppo-update (the imported model, or its warm start by sft)."""
    *_, start = policy_chain(store, policy_version)
    return start.version


def generating_policy(store: Store, stage: str, version: str) -> str:
    """The policy that generated the rollouts a version was computed from."""
    return store.ancestor(stage, version, "generate-rollouts").parents[POLICY]


def input_of(store: Store, name: str, given: dict[str, str]) -> str | None:
    """The version a stage reads as input `name`, when its caller did not give it: the policy of
    the rollouts it reads ("policy": the one that generated them, its critic, its tokenizer), the
    KL reference of that policy's lineage ("policy#reference"); None for an input that only its
    caller can give (the previous turn of generate-rollouts)."""
    if name in given:
        return given[name]
    rollouts = next(((stage, version) for stage, version in given.items() if stage.split("#")[0] != POLICY), None)
    if name not in (POLICY, REFERENCE) or rollouts is None:
        return None
    policy = generating_policy(store, *rollouts)
    return policy if name == POLICY else reference_policy(store, policy)


def run_config(store: Store, stage: str, version: str) -> dict[str, Any]:
    """The run config a version was made with (its manifest records it), which `mtrl stage` re-runs
    with (then its own flags and --set)."""
    return store.manifest(stage, version).config


def rebuild_hint(store: Store, stage: str, version: str) -> str:
    """How to get a missing trained policy back: the ppo-update or sft that wrote it, run again."""
    if stage != POLICY:
        return ""
    for writer in ("ppo-update", "sft"):
        if not (store.root / writer).is_dir():
            continue
        for made in store.versions(writer):
            if made.policy != version:
                continue
            if writer == "sft":
                return f"; sft/{made.version} wrote it: `mtrl sft` with the config of that run rebuilds it"
            source = f"compute-advantages/{made.parents['compute-advantages']}"
            trained = made.parents[POLICY]
            stale = trained != generating_policy(store, "compute-advantages", made.parents["compute-advantages"])
            policy = f" --policy {trained}" if stale else ""  # rollouts of an older policy (ppo.max_staleness)
            return f"; ppo-update/{made.version} wrote it: `mtrl stage ppo-update --from {source}{policy}` rebuilds it"
    return ""


def iteration_versions(store: Store, policy_version: str | None = None) -> list[list[Manifest]]:
    """The versions each iteration of the lineage ending at `policy_version` (default: the newest)
    made, oldest iteration first: its ppo-update first, then what it was made from, back to the
    policies (its turns' generate-rollouts and execute-tools, assign-rewards, compute-advantages)."""
    policy_version = policy_version or latest_policy(store)
    if policy_version is None:
        raise StoreError(f"no policy in {store.root}: nothing to report")
    made_by_iteration = []
    version = policy_version
    while "ppo-update" in (parents := store.manifest(POLICY, version).parents):  # back to RL's starting policy
        made = [m for m in store.walk_lineage("ppo-update", parents["ppo-update"], stop_at=POLICY) if m.stage != POLICY]
        made_by_iteration.append(made)
        version = made[0].parents[POLICY]
    return made_by_iteration[::-1]
