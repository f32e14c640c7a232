"""Served logprobs of the soft-capped and windowed families equal HF transformers' log_softmax
(top-k of each generated token and every prompt token, within TOL nats), and the windows are
shown to matter: HF's greedy output with the window differs from the same model's without it,
and ours equals HF's with it. Greedy tokens alone cannot see the final soft-cap (tanh is
monotonic) nor a window one key short, logprobs can."""

from __future__ import annotations

import pytest
import torch
from tiny_families import WINDOW, build_family

from engine import LLM, SamplingParams

TOL = 1e-4  # float32 against float32: about 1e-5 seen here
TOP = 3
NEW = 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (40, 70, 120)]


PROMPTS = _prompts()
assert all(len(p) > WINDOW for p in PROMPTS)

# label -> (family, checkpoint config changes, the soft-caps the engine must read from it)
CASES: dict[str, tuple[str, dict, tuple[float | None, float | None]]] = {
    "gemma2": ("gemma2", {}, (1.5, 3.0)),
    "gemma2-uncapped": ("gemma2", dict(attn_logit_softcapping=None,
                                       final_logit_softcapping=None), (None, None)),
    "gemma3": ("gemma3", {}, (None, None)),
    # NOTE: final soft-capping only: HF's Gemma 3 reads attn_logit_softcapping but never
    # applies it (transformers 5), so it is no reference for a capped Gemma 3 attention
    "gemma3-capped": ("gemma3", dict(final_logit_softcapping=3.0), (None, 3.0)),
    "qwen2-window": ("qwen2-window", {}, (None, None)),
    "mistral": ("mistral", {}, (None, None)),
    "phi3": ("phi3", {}, (None, None)),
}
WINDOWED = ["qwen2-window", "mistral", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bundled_tokenizer_dir):
    made: dict[str, object] = {}

    def get(label: str):
        if label not in made:
            family, extra, _ = CASES[label]
            made[label] = build_family(family, tmp_path_factory.mktemp(label),
                                       bundled_tokenizer_dir, **extra)
        return made[label]

    return get


def _hf(model_dir, **overrides):
    from transformers import AutoModelForCausalLM

    # NOTE: eager attention: HF's SDPA path drops attn_logit_softcapping without a word
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager", **overrides).eval()


def _greedy(model, ids: list[int]) -> list[int]:
    inp = torch.tensor([ids])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                         max_new_tokens=NEW, pad_token_id=2)
    return out[0, len(ids):].tolist()


def _close(got: dict[int, float], row: torch.Tensor, token: int, where: str) -> None:
    """Every logprob returned equals HF's; the alternatives are HF's top TOP, up to ties
    within TOL (the soft-capped logits crowd near their cap)."""
    assert token in got and len(got) >= TOP, where
    for t, value in got.items():
        assert value == pytest.approx(float(row[t]), abs=TOL), f"{where}, token {t}"
    kth = float(row.topk(TOP).values[-1])
    clear = (row > kth + TOL).nonzero().flatten().tolist()
    assert set(clear) <= set(got), f"{where}: top {clear} not in {sorted(got)}"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("label", list(CASES))
def test_logprobs_equal_hf_log_softmax(label, backend, checkpoint):
    llm = LLM(model=str(checkpoint(label)), attention_backend=backend)
    cfg = llm.engine.model_config
    assert (cfg.attn_softcap, cfg.final_softcap) == CASES[label][2]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP,
                            prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = _hf(checkpoint(label))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        gen = out.outputs[0]
        full = prompt + gen.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].double().log_softmax(-1)
        assert len(gen.logprobs) == NEW
        for j, got in enumerate(gen.logprobs):
            row, where = ref[len(prompt) - 1 + j], f"{label} on {backend}, prompt of {len(prompt)}"
            # greedy: HF's most likely token, up to a tie within both sides' error
            assert float(row[gen.token_ids[j]]) >= float(row.max()) - 2 * TOL, f"{where}, token {j}"
            _close(got, row, gen.token_ids[j], f"{where}, generated token {j}")
        for j in range(1, len(prompt)):
            _close(out.prompt_logprobs[j], ref[j - 1], prompt[j],
                   f"{label} on {backend}, prompt of {len(prompt)}, prompt token {j}")
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_the_greedy_output_and_ours_keeps_it(name, checkpoint):
    hf = [_greedy(_hf(checkpoint(name)), p) for p in PROMPTS]
    # NOTE: the same weights and layer types, a window longer than any sequence here
    unwindowed = [_greedy(_hf(checkpoint(name), sliding_window=4096), p) for p in PROMPTS]
    assert hf != unwindowed, f"{name}: the window changes nothing on these prompts"
    llm = LLM(model=str(checkpoint(name)))
    ours = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for prompt, out, ref in zip(PROMPTS, ours, hf, strict=True):
        assert out.outputs[0].token_ids == ref, f"{name}, prompt of {len(prompt)}"
