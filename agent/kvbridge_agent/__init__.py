"""kvbridge in-pod agent library.

Reading order:
- ``core``: pure plan math and compatibility rules (no torch, nixl, zmq or kubernetes); the operator uses it too.
- ``transfer``: the I/O every engine shares (NIXL, the side channel, a rank's side of a transfer).
- ``synthetic``: kvbridge's own test engine (``kvbridge-agent serve``), a model-less engine moving real KV bytes.
- ``vllm_connector``: the same transfers inside vLLM (``KVBridgeConnector``).
- ``bench``: ``kvbridge-agent bench`` and ``kvbridge-agent loopback``.
- ``cli``: the ``kvbridge-agent`` command line.
- ``__main__``: ``python -m kvbridge_agent``.

Layers, each importing only those below it (import-linter keeps it so): ``core``, ``transfer``, then the engines
(``synthetic``, ``vllm_connector``), then ``bench`` and ``cli``.
"""

__version__ = "0.1.0"
