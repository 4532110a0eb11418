"""kvbridge in-pod agent library.

``kvbridge_agent.core`` is the pure plan math (no torch, nixl, zmq or
kubernetes); ``kvbridge_agent.runtime`` does the I/O on top of it.
"""

__version__ = "0.1.0"
