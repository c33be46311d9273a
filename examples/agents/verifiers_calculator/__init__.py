"""The calculator task as a verifiers 0.4 environment (a taskset, a tool server and a harness).

It runs in its own environment, `.venv-verifiers` (`make setup`): verifiers needs openai<3, mtrl's
environment has openai 3. verifiers finds it by its taskset id, `verifiers_calculator`, with
examples/agents on PYTHONPATH (examples/agents/verifiers_agent.py sets it); `rollout.py` runs one
rollout of one task against an mtrl rollout's endpoint with verifiers' train client.
"""

from .harness import InstalledChatHarness
from .taskset import CalculatorTaskset

__all__ = ["CalculatorTaskset", "InstalledChatHarness"]
