"""kvbridge in-pod agent library.

Layers, each importing only those below it: ``core`` (pure plan math: no torch, nixl, zmq or kubernetes),
``transfer`` (the I/O every engine shares), then the engines — ``synthetic`` (kvbridge's own test engine) and
``vllm_connector`` (inside vLLM) — and ``bench`` (``kvbridge-agent bench`` and ``loopback``).
"""

__version__ = "0.1.0"
