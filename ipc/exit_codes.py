"""Process exit codes of `pagedserve serve` and `python -m engine` (docs/operations.md).

Distinct codes let a supervisor (systemd `Restart=on-failure`, a container runtime) tell a bad
config, which restarting cannot fix, from a dead engine or a drain that ran out of time.
"""

from __future__ import annotations

OK = 0
FAILURE = 1  # an unexpected error (a bug): the traceback is in the log
CONFIG_ERROR = 2  # bad flags or config values (argparse uses 2 too): fix the config first
ENGINE_DIED = 3  # the engine failed to load or start, or its loop died
DRAIN_TIMEOUT = 4  # the shutdown deadline passed with requests still running; they were aborted
LISTEN_FAILED = 5  # the gateway could not listen on --host/--port (in use, not permitted)

DESCRIPTIONS = {
    OK: "clean exit",
    FAILURE: "unexpected error",
    CONFIG_ERROR: "configuration error",
    ENGINE_DIED: "engine died or never became ready",
    DRAIN_TIMEOUT: "drain deadline passed; in-flight requests were aborted",
    LISTEN_FAILED: "could not listen on the address and port",
}
