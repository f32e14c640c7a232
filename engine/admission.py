"""An AddRequest becomes a Request: checked against the engine's limits and KV pool (bad input
raises ValueError naming the fault), its pooling and cross-encoder input settled, its LoRA
adapter's id looked up."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from engine.sched.request import Request
from engine.step_plan import choice_key
from ipc.limits import Limits, check_limits, check_pooling_input
from ipc.messages import AddRequest
from ipc.pooling import PoolingInfo, PoolingParams
from ipc.prefix_hash import salt_bytes

if TYPE_CHECKING:
    from engine.models.config import ModelConfig
    from engine.run.lora.slots import LoraSlots
    from engine.sched.kv_manager import KVCacheManager
    from engine.sched.scheduler import Scheduler
    from engine.sched.structured.compiler import GrammarCompiler


class Admission:
    """The checks an engine's requests pass before its scheduler queues them: limits (the
    context, as the KV pool holds it), ids not in use, and the pool's room for each."""

    def __init__(self, limits: Limits, num_gpu_blocks: int, kv: KVCacheManager,
                 scheduler: Scheduler, model_config: ModelConfig, pooling_info: PoolingInfo,
                 grammars: GrammarCompiler, lora: LoraSlots | None) -> None:
        self.limits, self.num_gpu_blocks = limits, num_gpu_blocks
        self.kv, self.scheduler, self.grammars, self.lora = kv, scheduler, grammars, lora
        self.model_config, self.pooling_info = model_config, pooling_info

    def request(self, msg: AddRequest) -> Request:
        """The request to queue (its other choices as its children); ValueError names the
        fault, and nothing has changed."""
        if msg.sampling.pooling is not None:
            return self._pooling(msg)
        prompt, s = msg.prompt_token_ids, msg.sampling
        if self.model_config.num_labels is not None:
            raise ValueError("this model is a cross-encoder (a sequence classifier with a score "
                             "head, no LM head): it scores pairs (rerank, score) and does not "
                             "generate")
        keys = [choice_key(msg.request_id, i) for i in range(s.num_choices)]
        if msg.request_id in self.scheduler.groups or any(map(self.scheduler.is_live, keys)):
            raise ValueError(f"request_id {msg.request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt must not be empty")
        check_limits(self.limits, prompt, s)
        max_model_len = self.limits.max_model_len
        max_tokens = max_model_len - len(prompt) if s.max_tokens is None else s.max_tokens
        blocks = self.kv.max_blocks_held(len(prompt) + max_tokens,
                                         self.scheduler.config.max_num_batched_tokens)
        if blocks > self.num_gpu_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {blocks} KV blocks; the pool has "
                f"{self.num_gpu_blocks}"
            )
        lora_id = self._lora_id(msg.lora_name)
        salt = salt_bytes(msg.cache_salt, None if lora_id is None else f"{msg.lora_name}#{lora_id}")
        choices = [
            Request(msg.request_id, list(prompt), s, max_tokens, msg.priority,
                    msg.arrival_time or time.time(), salt, index=i)
            for i in range(s.num_choices)
        ]
        for c in choices:
            c.lora_id = lora_id
        choices[0].children = choices[1:]
        if s.structured_outputs is not None:
            choices[0].pending_grammar = self.grammars.submit(s.structured_outputs)
        return choices[0]

    def _pooling(self, msg: AddRequest) -> Request:
        """A prefill-only request: its prompt must fit the context and the pool; its pooling
        gets the model's method and normalization where it set none."""
        prompt, s, info = msg.prompt_token_ids, msg.sampling, self.pooling_info
        assert s.pooling is not None
        if msg.request_id in self.scheduler.groups or self.scheduler.is_live(msg.request_id):
            raise ValueError(f"request_id {msg.request_id!r} is already in use")
        check_pooling_input(self.limits, prompt)
        blocks = self.kv.max_blocks_held(len(prompt), self.scheduler.config.max_num_batched_tokens)
        if blocks > self.num_gpu_blocks:
            raise ValueError(f"input needs {blocks} KV blocks; the pool has {self.num_gpu_blocks}")
        if s.pooling.dimensions is not None and not info.allows(s.pooling.dimensions):
            raise ValueError(f"dimensions {s.pooling.dimensions} is not one this model's "
                             f"{info.dimensions}-value embeddings can be truncated to")
        if info.num_labels is not None:
            prompt = cross_encoder_input(prompt, s.pooling, self.model_config.pad_token_id)
        pooling = msgspec.structs.replace(
            s.pooling, method=s.pooling.method or info.method,
            normalize=info.normalize if s.pooling.normalize is None else s.pooling.normalize)
        s = msgspec.structs.replace(s, pooling=pooling)
        return Request(msg.request_id, list(prompt), s, 0, msg.priority,
                       msg.arrival_time or time.time())

    def _lora_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        lora_id = None if self.lora is None else self.lora.id_of(name)
        if lora_id is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return lora_id


def cross_encoder_input(prompt: Sequence[int], params: PoolingParams,
                        pad: int | None) -> Sequence[int]:
    """A cross-encoder's input up to its last token that is not the config's pad id (HF's
    rule for the token its score head reads; the first token if all are pads).
    NOTE: the tokens after it cannot change its state (causal attention), so they are not
    computed at all."""
    if params.method not in (None, "last") or params.dimensions is not None:
        raise ValueError("a cross-encoder pools the last token with its score head: no "
                         "pooling method or dimensions to choose")
    end = len(prompt)
    while pad is not None and end > 1 and prompt[end - 1] == pad:
        end -= 1
    return prompt[:end]
