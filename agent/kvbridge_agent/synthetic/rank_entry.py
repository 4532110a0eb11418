"""Spawn target of rank processes, importable without torch (the engine process never loads it)."""

from __future__ import annotations

from multiprocessing.connection import Connection


def main(env_json: str, rank: int, incarnation: str, conn: Connection, log_level: str) -> None:
    from kvbridge_agent.synthetic.rank_worker import rank_main

    rank_main(env_json, rank, incarnation, conn, log_level)
