"""How a run runs: the Prefect flows of an iteration and of a training (flows.py), one Prefect task that runs
any stage into the store (stage_runs.py), the stage table it reads (stage_table.py), the checks before a run
starts (preflight.py), where execute-tools and assign-rewards run (runners.py), and the same stages played in
memory without Prefect or the store (episodes.py)."""
