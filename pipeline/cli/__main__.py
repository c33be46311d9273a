"""`python -m pipeline.cli ...`: the `mtrl` command, run by the interpreter that runs this."""

from pipeline.cli.main import entry

entry()
