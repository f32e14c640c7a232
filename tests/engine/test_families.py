"""Every model family's greedy output equals HF transformers' `generate`, token for token, on
tiny random checkpoints built by transformers' own classes (tests/tiny_families.py), over
prompts longer than the sliding window: default and torch backends, chunked prefill, a warm
prefix cache, preemption by swap and by recompute, n-gram and self-draft speculation. KV blocks
balance after each run; a long windowed request holds a bounded number of blocks."""

from __future__ import annotations

import pytest
import torch
from tiny_families import FAMILIES, WINDOW, build_family
from tiny_gguf import ARCHS, write_gguf

from engine import LLM, SamplingParams
from engine.sched.kv_manager import held

MAX_NEW = 10
LENGTHS = [5, 31, 61, 90]  # all but the first longer than the window (24)
WINDOWED = ["qwen2-window", "mistral", "gemma2", "gemma3", "phi3"]
ALL_WINDOWED = ["mistral", "phi3"]  # every layer windowed: blocks behind it are released


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, bundled_tokenizer_dir):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = build_family(name, tmp_path_factory.mktemp(name), bundled_tokenizer_dir)
        return made[name]

    return get


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    segment = torch.randint(3, 49000, (23,), generator=g).tolist()
    noise = torch.randint(3, 49000, (100,), generator=g).tolist()
    # NOTE: a repeated segment gives the n-gram proposer matches to verify
    base = (segment + noise[:7]) * 3 + noise
    return [base[:n] for n in LENGTHS]


PROMPTS = _prompts()


@pytest.fixture(scope="session")
def hf_tokens(family_dirs):
    refs = {}

    def get(name: str) -> list[list[int]]:
        if name not in refs:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(family_dirs(name),
                                                         dtype=torch.float32).eval()
            refs[name] = []
            for ids in PROMPTS:
                inp = torch.tensor([ids])
                out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                     max_new_tokens=MAX_NEW, pad_token_id=2)
                refs[name].append(out[0, len(ids):].tolist())
        return refs[name]

    return get


def run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def check(llm: LLM, ours: list[list[int]], ref: list[list[int]], label: str) -> None:
    for n, a, b in zip(LENGTHS, ours, ref, strict=True):
        assert a == b, f"{label}, prompt of {n} tokens: {a} != HF {b}"
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_equals_hf(name, backend, family_dirs, hf_tokens):
    llm = LLM(model=str(family_dirs(name)), attention_backend=backend)
    check(llm, run(llm), hf_tokens(name), f"{name} on {backend}")


MODES = {
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preempt-swap": {"num_gpu_blocks": 8, "max_num_batched_tokens": 64,
                     "preemption_mode": "swap"},
    "preempt-recompute": {"num_gpu_blocks": 8, "max_num_batched_tokens": 64,
                          "preemption_mode": "recompute"},
    "spec-ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "spec-self": {"speculative_method": "self", "speculative_draft_layers": 1},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["llama3", "qwen3", *WINDOWED])
def test_family_modes_equal_hf(name, mode, family_dirs, hf_tokens):
    options = dict(MODES[mode])
    if mode.startswith("preempt") and name in ALL_WINDOWED:
        # NOTE: these hold a window's blocks at most (4 with 16-token steps): a smaller pool
        options.update(num_gpu_blocks=5, max_num_batched_tokens=16)
    llm = LLM(model=str(family_dirs(name)), **options)
    check(llm, run(llm), hf_tokens(name), f"{name} {mode}")
    stats = llm.engine.stats()
    if mode == "preempt-swap":
        assert stats.num_preemptions_swap > 0 and stats.swap_out_bytes == stats.swap_in_bytes
    elif mode == "preempt-recompute":
        assert stats.num_preemptions_recompute > 0
    elif mode == "spec-self":
        assert stats.spec_verify_steps > 0
    elif mode == "spec-ngram" and name not in ALL_WINDOWED:
        # NOTE: a proposer that finds nothing fails here. The all-windowed models' outputs
        # never repeat a context n-gram on these prompts (nothing to draft): for them,
        # test_ngram_drafts_are_accepted_by_a_windowed_model
        assert stats.spec_accepted_tokens > 0, stats


@pytest.mark.parametrize("name", ALL_WINDOWED)
def test_ngram_drafts_are_accepted_by_a_windowed_model(name, family_dirs):
    """Every layer windowed (2 layers of 24): the next token depends on the last 47 only, and
    rope is relative, so after B + G + B (G: HF's greedy continuation of B) the model says G
    again, which is what the n-gram proposer drafts from the first B."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs(name), dtype=torch.float32).eval()

    def greedy(ids: list[int]) -> list[int]:
        inp = torch.tensor([ids])
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                             max_new_tokens=MAX_NEW, pad_token_id=2)
        return out[0, len(ids):].tolist()

    b = PROMPTS[3][30:80]
    prompt = b + greedy(b) + b
    ref = greedy(prompt)
    llm = LLM(model=str(family_dirs(name)), speculative_method="ngram", num_speculative_tokens=3)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0]
    assert out.outputs[0].token_ids == ref
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_warm_prefix_cache_gives_the_same_tokens(name, family_dirs, hf_tokens):
    llm = LLM(model=str(family_dirs(name)))
    run(llm)  # warm
    before = llm.engine.stats().prefix_cache_hits
    check(llm, run(llm), hf_tokens(name), f"{name} cached")
    assert llm.engine.stats().prefix_cache_hits - before > sum(LENGTHS) // 2


def test_a_long_windowed_request_holds_a_bounded_number_of_blocks(family_dirs):
    """Mistral (every layer windowed): 300 tokens would need 19 blocks; it holds at most the
    window's and one step's. Gemma 3 (mixed) keeps them all."""
    for name, bound in (("mistral", -(-(WINDOW - 1 + 16) // 16) + 1), ("gemma3", None)):
        llm = LLM(model=str(family_dirs(name)), max_num_batched_tokens=16)
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=260, ignore_eos=True)
        from ipc.messages import AddRequest

        engine.add_request(AddRequest("long", PROMPTS[3][:40], params))
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            for req in engine.scheduler.running:
                most = max(most, len(held(engine.kv.block_ids(req.key))))
        total = -(-300 // 16)
        assert most <= bound if bound is not None else most == total, (name, most)
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total


# NOTE: llama.cpp scales Gemma's queries by head_dim ** -0.5 (query_pre_attn_scalar is no GGUF
# key): these checkpoints set it to the head dim, as the released 2B/9B/270M models do.
GGUF_EXTRA = {"gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {"query_pre_attn_scalar": 16}}


@pytest.mark.parametrize("name", list(ARCHS))
def test_gguf_of_each_family_gives_the_safetensors_tokens(name, tmp_path, bundled_tokenizer_dir,
                                                          monkeypatch):
    """The checkpoint written by the `gguf` writer under the family's architecture loads to
    the same tokens as its safetensors (and as HF on those)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = build_family(name, tmp_path / "hf", bundled_tokenizer_dir, **GGUF_EXTRA.get(name, {}))
    path = write_gguf(hf_dir, tmp_path / f"{name}.gguf", ARCHS[name])
    from_st = LLM(model=str(hf_dir))
    st_tokens = run(from_st)
    check(from_st, st_tokens, _hf_generate(hf_dir), f"{name} safetensors")
    from_gguf = LLM(model=str(path), tokenizer=str(hf_dir), quantization_numerics="a32")
    assert from_gguf.engine.model_config.layer_windows == from_st.engine.model_config.layer_windows
    check(from_gguf, run(from_gguf), st_tokens, f"{name} GGUF")


def _hf_generate(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for ids in PROMPTS:
        inp = torch.tensor([ids])
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                             max_new_tokens=MAX_NEW, pad_token_id=2)
        refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.mark.parametrize("draft", ["phi3", "llama3"])
def test_a_separate_draft_model_shares_the_windowed_tables(draft, family_dirs, hf_tokens):
    """The draft's caches live under the target's block tables: blocks are released only
    behind a window both models keep (Phi-3's 24), never with a global draft (Llama)."""
    llm = LLM(model=str(family_dirs("mistral")), speculative_method="draft",
              speculative_model=str(family_dirs(draft)), num_speculative_tokens=3)
    assert llm.engine.kv.window == (WINDOW if draft == "phi3" else None)
    check(llm, run(llm), hf_tokens("mistral"), f"mistral with a {draft} draft")
    assert llm.engine.stats().spec_verify_steps > 0
