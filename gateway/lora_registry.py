"""The LoRA adapters one model's engines serve, as the gateway knows them (name -> PEFT
directory), and whether the run-time load/unload routes are allowed."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# NOTE: vLLM's switch for the two routes, read as vLLM reads it ("1" or "true", any case)
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true")


@dataclass
class LoraRegistry:
    """The adapters one model's engines serve: name -> PEFT directory, and when each appeared."""

    enabled: bool = False  # the model's engines run with --enable-lora
    paths: dict[str, str] = field(default_factory=dict)
    created: dict[str, int] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)  # names asked of the engines, not answered

    @classmethod
    def from_modules(cls, enabled: bool, modules: tuple[str, ...]) -> LoraRegistry:
        paths = dict(entry.partition("=")[::2] for entry in modules)
        return cls(enabled, paths, dict.fromkeys(paths, int(time.time())))

    def holds(self, name: str) -> bool:
        """Whether `name` is one of these adapters, or one on its way in."""
        return name in self.paths or name in self.loading

    def set(self, names: list[str], name: str, path: str | None) -> None:
        """After an engine answered: `names` are loaded; `name` was added (path) or removed."""
        if path is not None:
            self.paths[name], self.created[name] = path, int(time.time())
        else:
            self.paths.pop(name, None)
            self.created.pop(name, None)
        for gone in set(self.paths) - set(names):
            self.paths.pop(gone)
            self.created.pop(gone, None)
