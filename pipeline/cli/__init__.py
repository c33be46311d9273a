"""The command line: `mtrl` and its commands (main.py), the config's documentation (config_docs.py), and the
script that built the embedded tiny model (embedded_build.py). The top of the house: it imports every other
part of pipeline/, and nothing imports it."""
