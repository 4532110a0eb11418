"""kvbridge operator: the DisaggregatedDeployment resource, its Kopf controller and the ``kvbridge`` CLI.

Imports only the agent's pure core (``kvbridge_agent.core``), never its runtime.
"""

__version__ = "0.1.0"
