"""What an object lacks of engine.process.Core, the engine loop's typed interface (the loop
reads every member as it is: no getattr probes with defaults)."""

from __future__ import annotations

import types
import typing

from engine.process import Core


def core_protocol_gaps(core: object) -> list[str]:
    """Core's members `core` does not have, or has with another type (data members: their
    annotated type; methods: callables)."""
    gaps = []
    for name, hint in typing.get_type_hints(Core).items():
        origin = typing.get_origin(hint)
        kind = (tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
                if origin in (typing.Union, types.UnionType) else origin or hint)
        if not hasattr(core, name) or not isinstance(getattr(core, name), kind):
            gaps.append(f"{name}: {hint}")
    methods = [n for n, v in vars(Core).items() if callable(v) and not n.startswith("_")]
    gaps += [f"{n}()" for n in methods if not callable(getattr(core, n, None))]
    return gaps
