"""mtrl and Prefect: the settings mtrl runs Prefect with (settings.py), the local API servers a run starts
for itself (servers.py, each one the process of api_server.py), and every place mtrl relies on Prefect's
internals (patches.py)."""
