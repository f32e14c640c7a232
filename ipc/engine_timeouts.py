"""How long the gateway waits for its engines, and how often they beat: one default per timeout,
read by the flag parsers, EngineClient, EnginePool and the engine loop alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineTimeouts:
    # NOTE: the engine heart-beats between steps only, and one long prefill step on a CPU can
    # take several seconds: a tight timeout would kill healthy engines.
    heartbeat_timeout: float = 30.0  # seconds without a heartbeat before an engine is dead
    heartbeat_interval: float = 1.0  # seconds between an engine's heartbeats (its flag)
    startup_timeout: float = 300.0  # seconds an engine may take to become ready

