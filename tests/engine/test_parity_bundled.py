"""Greedy output of the engine equals HF transformers token for token on the bundled model,
also under chunked prefill and under preemption. At a near-tie (HF log-probs of the two tokens
within 1e-3) the engine is fed HF's token (teacher forcing) and the rest of the sequence is
still compared; any other difference fails.
"""

from __future__ import annotations

import pytest
import torch
from gguf_in_memory import hf_from_gguf

from engine import LLM, SamplingParams
from kernels.cpu import quant as cpu_quant

MAX_NEW = 24
LENGTHS = [1, 5, 17, 32, 64, 100, 181, 300]
NEAR_TIE = 1e-3

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how knowledge spread across Europe. Scholars, merchants and priests all found "
    "new uses for cheap books, and literacy rose in the cities first. "
)


@pytest.fixture(scope="module")
def prompts(bundled_tokenizer_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir)
    ids = tok(TEXT * 12)["input_ids"]
    assert len(ids) >= max(LENGTHS)
    return [ids[:n] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_reference(prompts):
    """(tokens, per-step log-probs) of HF greedy generate for each prompt, run one by one."""
    from ipc.model_source import bundled_gguf

    model = hf_from_gguf(bundled_gguf(), dtype=torch.float32).eval()
    refs = []
    for ids in prompts:
        inp = torch.tensor([ids])
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=MAX_NEW,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=2)
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [s[0].float().log_softmax(-1) for s in out.scores]
        refs.append((tokens, logprobs))
    return refs


@pytest.fixture(scope="module")
def llm_factory():
    made = {}

    def make(**options) -> LLM:
        # NOTE: HF's tokens are a32's (exact) numerics: the default for this GGUF is a8
        options.setdefault("quantization_numerics", "a32")
        key = tuple(sorted(options.items()))
        if key not in made:
            made.clear()  # one bundled model in memory at a time
            made[key] = LLM(**options)
        return made[key]

    return make


def assert_parity(llm: LLM, prompt: list[int], ours: list[int],
                  ref: tuple[list[int], list[torch.Tensor]], label: str) -> int:
    """Compare with HF's greedy tokens over the whole sequence; returns the near-ties met.

    At a near-tie the engine continues from the prompt plus HF's tokens so far (teacher
    forcing): HF's later tokens and log-probs are conditioned on HF's choice, so ours must be.
    """
    tokens, logprobs = ref
    ties, start = 0, 0
    while True:
        diff = next((i for i in range(start, min(len(ours), len(tokens)))
                     if ours[i] != tokens[i]), None)
        if diff is None:
            assert ours == tokens, f"{label}: {ours} != {tokens} (lengths differ)"
            return ties
        a, b = ours[diff], tokens[diff]
        gap = abs(float(logprobs[diff][a]) - float(logprobs[diff][b]))
        assert gap <= NEAR_TIE, f"{label}: token {diff} is {a}, HF says {b} (logprob gap {gap})"
        ties += 1
        print(f"near-tie for {label} at token {diff}: {a} vs {b}, gap {gap:.2e}; teacher forcing")
        forced = tokens[:diff + 1]
        rest = []
        if len(forced) < MAX_NEW:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW - len(forced))
            rest = llm.generate([{"prompt_token_ids": prompt + forced}], params)[0].token_ids
        ours, start = forced + rest, diff + 1


def test_teacher_forcing_continues_past_a_near_tie(prompts, hf_reference, llm_factory):
    """The helper itself: a faked near-tie at token 3 must not end the comparison there, and a
    wrong token after it must still fail."""
    llm = llm_factory()
    tokens, logprobs = hf_reference[2]
    tied = [t.clone() for t in logprobs]
    other = int(tied[3].argsort(descending=True)[1])
    tied[3][other] = tied[3][tokens[3]]  # make token 3 a tie between HF's choice and another
    ours = tokens[:3] + [other] + tokens[4:]
    assert assert_parity(llm, prompts[2], ours, (tokens, tied), "faked tie") == 1
    wrong = tokens[:-1] + [int(tied[-1].argmin())]  # HF's least likely last token
    with pytest.raises(AssertionError, match="logprob gap"):
        # NOTE: teacher forcing regenerates the tail, so the error is planted in the reference
        assert_parity(llm, prompts[2], ours, (wrong, tied), "faked tie, then a wrong token")


def expected_kernels(options: dict) -> tuple[str, str]:
    """The attention backend and linear mode that must run on this machine (x86-64 Linux with
    a C compiler and room for dual's second copy, as `make test` sets up): the production CPU
    path, never a silent torch fallback."""
    attention = options.get("attention_backend", "cpu")
    # NOTE: auto on the quantized GGUF: no dense nn.Linear is left to pack, so torch
    quantized = options.get("quantization", "auto") != "none"
    linear = options.get("cpu_linear", "torch" if quantized else "dual")
    return attention, linear


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="default"),  # NOTE: the GGUF's own Q4_1/Q8_0 blocks, a32 pinned
        pytest.param({"quantization": "none"}, id="dequantized"),
        pytest.param({"cpu_linear": "torch", "attention_backend": "torch"}, id="torch-reference"),
        pytest.param({"cpu_linear": "onednn"}, id="linear-onednn"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill"),
        pytest.param({"num_gpu_blocks": 26, "max_num_batched_tokens": 128,
                      "preemption_mode": "recompute"}, id="preempt-recompute"),
        pytest.param({"num_gpu_blocks": 26, "max_num_batched_tokens": 128,
                      "preemption_mode": "swap"}, id="preempt-swap"),
        pytest.param({"speculative_method": "ngram"}, id="spec-ngram"),
        pytest.param({"speculative_method": "self", "speculative_draft_layers": 8},
                     id="spec-self"),
    ],
)
def test_greedy_parity_with_hf(options, prompts, hf_reference, llm_factory):
    llm = llm_factory(**options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    assert (llm.engine.attention_backend, llm.engine.cpu_linear) == expected_kernels(options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out, ref in zip(prompts, outs, hf_reference, strict=True):
        assert_parity(llm, p, out.token_ids, ref, f"{options} prompt of {len(p)} tokens")
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    mode = options.get("preemption_mode")
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
        assert stats.swap_out_bytes == stats.swap_in_bytes > 0
    elif mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    else:
        assert stats.num_preemptions == 0
    stack = llm.engine.runner.model.decode_stack
    if (llm.engine.quantization == "gguf" and llm.engine.attention_backend == "cpu"
            and cpu_quant.isa_supported("avx512") and "speculative_method" not in options):
        assert stack is not None and stack.calls > 0  # NOTE: the one-call decode stack ran
    if "speculative_method" in options:
        assert stats.spec_verify_steps > 0
        if options["speculative_method"] == "ngram":  # the prompts repeat one passage
            assert stats.spec_accepted_tokens > 0


def test_a8_numerics_agreement(prompts, hf_reference, llm_factory, capsys):
    """a8 (int8 activations) is not exact: report its agreement with HF over the prompts."""
    llm = llm_factory(quantization_numerics="a8")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    agree = []
    for out, (tokens, _) in zip(outs, hf_reference, strict=True):
        pairs = enumerate(zip(out.token_ids, tokens, strict=False))
        agree.append(next((i for i, (a, b) in pairs if a != b), len(tokens)))
    with capsys.disabled():
        print(f"\na8 vs HF: tokens before the first difference per prompt {agree} of {MAX_NEW}")
    assert sum(agree) >= len(prompts) * MAX_NEW // 2


def test_prefix_cache_hits_give_the_same_tokens(prompts, hf_reference, llm_factory):
    """The prompts share prefixes: a second pass computes only what the cache lacks."""
    llm = llm_factory()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    llm.generate([{"prompt_token_ids": prompts[-1]}], params)  # warm: the longest prompt
    before = llm.engine.stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    after = llm.engine.stats()
    for p, out, ref in zip(prompts, outs, hf_reference, strict=True):
        assert_parity(llm, p, out.token_ids, ref, f"cached prompt of {len(p)} tokens")
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    cached = sum(o.num_cached_tokens for o in outs)
    assert hits == cached > 0.8 * sum(len(p) for p in prompts)
    assert outs[-1].num_cached_tokens == 288  # 300 tokens: 18 full blocks, the last recomputed


def test_capital_of_france(llm_factory):
    llm = llm_factory()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_greedy_parity_with_a_separate_draft_model(prompts, hf_reference, llm_factory,
                                                   tiny_model_dir):
    """A tiny random model with the same tokenizer as the draft: its proposals are mostly
    rejected, and the output must still be the target's own, token for token."""
    llm = llm_factory(speculative_method="draft", speculative_model=str(tiny_model_dir),
                      num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out, ref in zip(prompts, outs, hf_reference, strict=True):
        assert_parity(llm, p, out.token_ids, ref, f"draft-model prompt of {len(p)} tokens")
    stats = llm.engine.stats()
    assert stats.spec_verify_steps > 0 and stats.kv_blocks_free == stats.kv_blocks_total
