"""The cost of LoRA adapters: tokens/s of a 16-stream batch with 0, 1 and 4 distinct adapters,
against the base model in the same run and on the same engine (in-process, ignore_eos).

    python -m bench.lora [--streams 16] [--prompt-len 64] [--output-len 32] [--rank 16]
                         [--rounds 2] [engine flags]

The adapters are random PEFT-format directories (adapter_config.json + safetensors) over every
projection (q/k/v/o, gate/up/down), written for the model's own shapes. Rounds interleave the
cases so that the machine's drift falls on all of them; the median of each is quoted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ipc.config import add_engine_args, config_from_args
from ipc.sampling import SamplingParams

_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
            "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: Path, cfg, rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's layout for a model of `cfg` (engine ModelConfig)."""
    import torch
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{_MODULES[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(shapes)}))
    return out


def _run(llm, prompts: list[list[int]], loras: list[str | None], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    add_engine_args(p)
    args = p.parse_args(argv)
    from engine import LLM

    config = config_from_args(args).replace(enable_lora=True, max_loras=4,
                                            max_lora_rank=max(args.rank, 1),
                                            enable_prefix_caching=False)
    llm = LLM(**{k: getattr(config, k) for k in config.__dataclass_fields__})
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(4):
            path = write_adapter(Path(tmp) / f"a{i}", llm.engine.model_config, args.rank, i)
            llm.engine.load_lora(f"a{i}", str(path))
        n = args.streams
        prompts = [[100 + (i * 7 + j) % 40000 for j in range(args.prompt_len)] for i in range(n)]
        cases = {"base (no adapter)": [None] * n, "1 adapter": ["a0"] * n,
                 "4 adapters": [f"a{i % 4}" for i in range(n)]}
        _run(llm, prompts[:2], [None, "a0"], 4)  # NOTE: warm-up (first-touch pages, packing)
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, loras in cases.items():
                rates[name].append(_run(llm, prompts, loras, args.output_len))
                print(f"  ran {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    base = statistics.median(rates["base (no adapter)"])
    print(f"model {llm.engine.model_name} ({llm.engine.quantization}, cpu_linear "
          f"{llm.engine.cpu_linear}), {n} streams, {args.prompt_len} + {args.output_len} "
          f"tokens, rank {args.rank}, {args.rounds} rounds")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:18s} {median:8.1f} tok/s  x{median / base:.2f} of base   "
              f"(each: {', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
