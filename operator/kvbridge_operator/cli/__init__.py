"""The ``kvbridge`` command.

Reading order:
- ``main``: every subcommand.
- ``plan_report``: what ``kvbridge plan`` prints: what runs each role (engine, image), the plan, the commands.
- ``plan_sections``: the plan's sections beyond the transfer: verification, router, planner, parallelism, tracing.
- ``provenance``: what has been run for real of a spec's configuration: one table of the runs.
- ``manifests``: reading manifests safely.
- ``hf_config``: ``kvbridge model``: ``spec.model`` from a Hugging Face ``config.json``.
- ``hf_layers``: what each layer of such a model keeps per token, and its state-space layers, as vLLM reads them.
- ``profile``: ``kvbridge profile``: the planner's performance profile, measured with ``vllm bench serve``.
- ``arguments``: the argparse types the commands share.

``kvbridge demo`` is contributed by ``kvbridge_sim`` through the ``kvbridge.commands`` entry points. The router is
a program of its own, ``kvbridge-router`` (``kvbridge_router.cli``): the operator imports nothing of it.
"""
