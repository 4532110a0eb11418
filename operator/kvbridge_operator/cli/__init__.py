"""The ``kvbridge`` command.

Reading order:
- ``main``: every subcommand.
- ``plan_report``: what ``kvbridge plan`` prints.
- ``manifests``: reading manifests safely.
- ``hf_config``: ``kvbridge model``: ``spec.model`` from a Hugging Face ``config.json``.
- ``profile``: ``kvbridge profile``: the planner's performance profile, measured with ``vllm bench serve``.
- ``arguments``: the argparse types the commands share.

``kvbridge demo`` is contributed by ``kvbridge_sim`` through the ``kvbridge.commands`` entry points; ``kvbridge
router`` is the router's own command line (``kvbridge_router.cli``, also ``kvbridge-router``).
"""
