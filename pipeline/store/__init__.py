"""The versioned store and what is read from it: versions written atomically, one folder each (versions.py),
what a run's versions say about each other (lineage.py), what a run keeps (retention.py), two runs compared
by their data (diff.py), and the audit of a stage's data before anything trains on it (audit.py)."""
