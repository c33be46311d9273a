"""Store retention: after each ppo-update, the policies of the new policy's lineage older than
its newest `store.keep_optimizer_state` lose their AdamW state (docs/store.md).

A trained policy is its weights, tokenizer and value head, which generation, scoring, reports
and `mtrl diff` read, plus the AdamW state that only a ppo-update continuing from it reads:
two fp32 moments per trainable parameter, twice the size of fp32 weights. Only that state is
deleted; the policy keeps its version, its manifest (which records the pruning) and its lineage,
so no version changes. Only the new policy's lineage is pruned: other branches of a shared runs
directory belong to other runs, which keep their own newest states.
"""

from __future__ import annotations

from typing import Any

from pipeline.store.lineage import policy_chain
from pipeline.store.versions import Store
from schemas.manifest import Manifest, StoreError
from schemas.stage import POLICY
from stages.ppo_update.checkpoint import OPTIMIZER_FILE


class PrunedStateError(StoreError):
    """A ppo-update would continue an AdamW state that retention deleted."""

    def __init__(self, policy: Manifest):
        self.pruned: dict[str, Any] = policy.pruned[OPTIMIZER_FILE]  # when and why
        super().__init__(
            f"ppo-update would continue the AdamW state of policy/{policy.version} (iteration {policy.iteration}), "
            f"but retention pruned it at {self.pruned['at']} ({self.pruned['reason']}), and a fresh AdamW trains "
            "another update. Set store.fresh_optimizer_if_pruned=true to train it with a fresh AdamW (a new "
            "ppo-update version), or raise store.keep_optimizer_state so that future runs keep more states"
        )


def optimizer_state_gone(store: Store, policy_version: str) -> PrunedStateError | None:
    """The error a ppo-update continuing this policy's AdamW state meets when retention pruned it (its
    `pruned`: when and why); None while the policy has its state, and for a policy that never had one
    (the starting model, a LoRA update's policy)."""
    policy = store.manifest(POLICY, policy_version)
    return PrunedStateError(policy) if OPTIMIZER_FILE in policy.pruned else None


def prune_optimizer_states(store: Store, policy_version: str, keep: int) -> list[str]:
    """Prune the AdamW state of the policies in `policy_version`'s lineage older than its newest
    `keep` (the policy itself is the newest); returns the policies pruned now, oldest first.

    The walk back stops at the first policy already pruned: passes prune oldest first, so a
    pass that a crash cut short left every policy older than its last one pruned, and the
    next pass finishes that one (deleting a file its manifest already calls pruned)."""
    reason = f"store.keep_optimizer_state={keep}: older than the newest {keep} policies of policy/{policy_version}"
    prunable = []
    for newer, manifest in enumerate(policy_chain(store, policy_version)):
        if newer < keep or OPTIMIZER_FILE not in manifest.files:
            continue  # kept, or never had a state (the starting model, a LoRA update's policy)
        if OPTIMIZER_FILE in manifest.pruned:
            store.prune(POLICY, manifest.version, [OPTIMIZER_FILE], reason)  # deletes what a crash left
            break
        prunable.append(manifest.version)
    for version in reversed(prunable):
        store.prune(POLICY, version, [OPTIMIZER_FILE], reason)
    return prunable[::-1]


def prune_lineage(store: Store, keep: int, policy_version: str) -> list[str]:
    """Retention after a ppo-update is stored whole (its metrics and the policy it wrote): a crash
    before this point re-runs that update, which still finds its policy's AdamW state. Logs what it
    pruned in the current Prefect run; returns it."""
    pruned = prune_optimizer_states(store, policy_version, keep)
    if pruned:
        from prefect import get_run_logger

        get_run_logger().info(
            "retention (store.keep_optimizer_state=%d): pruned the AdamW state of policy %s", keep, ", ".join(pruned)
        )
    return pruned
