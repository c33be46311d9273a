"""What a person watches while a run runs and after it: the run's report and learning curve (report.py), its
live line on the terminal (progress.py), experiment trackers (tracking.py), the rollouts in a browser
(viewer.py), and the tables and progress bars in the Prefect UI (artifacts.py)."""
