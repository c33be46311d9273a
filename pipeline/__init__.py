"""Orchestration: everything above the stages, one sub-package per concern, each importing only those below it:

cli/                the `mtrl` command
orchestration/      the flows, and how a stage runs into the store
monitoring/         what a person watches: report, progress line, trackers, viewer, Prefect artifacts
models/             where the starting policy comes from (the embedded tiny model among them)
store/              the versioned store, its lineage, retention, diff and audit
prefect_plumbing/   the settings, servers and patches mtrl runs Prefect with
"""
