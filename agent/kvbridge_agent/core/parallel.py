"""Data and expert parallelism: what a role's data-parallel ranks and expert parallelism change for KV.

A data-parallel (DP) rank is an attention replica of ``tensorParallelSize`` ranks with its own requests and its own
KV cache. To the other role it is an engine of its own: one engine id (vLLM appends ``_dp<rank>`` to the engine's,
``v1/engine/core.py``) and one side channel on ``base port + rank`` (vLLM's NixlConnector adds
``data_parallel_index`` to ``VLLM_NIXL_SIDE_CHANNEL_PORT``; kvbridge's connector does the same). A decode DP rank
reads a request from the one prefill DP rank that computed it (the transfer parameters name its engine id and
port); TP inside a DP rank follows the pair rules, so the plan of a DP rank is the plan of a TP pair. Expert
parallelism shards experts over all ``DP x TP`` ranks of an engine; experts hold no KV, so it changes no KV
geometry. MLA with DP attention (the DeepSeek serving layout) keeps each request's whole latent on one DP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelGeometry, RoleSettings, TransferSettings


def engine_id_of_rank(engine_id: str, dp_rank: int, dp_size: int) -> str:
    """The engine id of one DP rank: vLLM's suffix ``_dp<rank>`` when the engine has several, else the engine's."""
    return f"{engine_id}_dp{dp_rank}" if dp_size > 1 else engine_id


def side_channel_port_of_rank(base_port: int, dp_rank: int) -> int:
    """The side-channel port of one DP rank: ``base + rank`` (docs/protocol.md §5; vLLM's NixlConnector's too)."""
    return base_port + dp_rank


def ranks_words(settings: RoleSettings) -> str:
    """A role's ranks in a few words: ``TP 4``, or ``DP 8 x TP 1, EP`` with data or expert parallelism."""
    tp = f"TP {settings.tensor_parallel_size}"
    words = f"DP {settings.data_parallel_size} x {tp}" if settings.data_parallel_size > 1 else tp
    return f"{words}, EP" if settings.expert_parallel else words


@dataclass(frozen=True)
class RoleParallelism:
    """One role's engine as ranks: DP ranks of TP ranks, and whether experts are sharded over all of them."""

    data_parallel_size: int
    tensor_parallel_size: int
    expert_parallel: bool
    side_channel_ports: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    def to_dict(self) -> dict[str, object]:
        return {
            "dataParallelSize": self.data_parallel_size,
            "tensorParallelSize": self.tensor_parallel_size,
            "worldSize": self.world_size,
            "expertParallel": self.expert_parallel,
            "expertParallelSize": self.world_size if self.expert_parallel else 1,
            "kvCaches": self.data_parallel_size,
            "sideChannelPorts": list(self.side_channel_ports),
        }


def role_parallelism(settings: RoleSettings, transfer: TransferSettings) -> RoleParallelism:
    dp = settings.data_parallel_size
    return RoleParallelism(
        data_parallel_size=dp,
        tensor_parallel_size=settings.tensor_parallel_size,
        expert_parallel=settings.expert_parallel,
        side_channel_ports=tuple(side_channel_port_of_rank(transfer.side_channel_port, r) for r in range(dp)),
    )


def parallelism(
    model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings, transfer: TransferSettings
) -> dict[str, object]:
    """Both roles as ranks, and what that changes for KV, in CRD words (``kvbridge plan --json``'s
    ``parallelism``)."""
    return {
        "prefill": role_parallelism(prefill, transfer).to_dict(),
        "decode": role_parallelism(decode, transfer).to_dict(),
        # every decode DP rank may read from every prefill DP rank of every prefill engine it is paired with
        "prefillPeersPerEngine": prefill.data_parallel_size,
        "numExperts": model.num_experts,
        "kv": kv_words(model, prefill, decode),
    }


def kv_words(model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings) -> list[str]:
    """What the roles' DP and EP change for KV, one sentence each (the plan's text and JSON)."""
    words: list[str] = []
    if prefill.data_parallel_size > 1 or decode.data_parallel_size > 1:
        words.append(
            f"data parallelism: prefill {prefill.data_parallel_size} and decode {decode.data_parallel_size} KV "
            "cache(s) per engine, each DP rank a transfer peer of its own (engine id <engine>_dp<rank>, side "
            "channel on base port + rank); a decode DP rank reads a request from the prefill DP rank that "
            "computed it, TP inside a DP rank as planned"
        )
    if prefill.expert_parallel or decode.expert_parallel:
        words.append(
            f"expert parallelism: {model.num_experts} experts sharded over each engine's DP x TP ranks; experts "
            "hold no KV, the KV geometry is unchanged"
        )
    if model.is_mla and (prefill.data_parallel_size > 1 or decode.data_parallel_size > 1):
        words.append("MLA with DP attention (the DeepSeek layout): a request's whole latent lives on one DP rank")
    return words
