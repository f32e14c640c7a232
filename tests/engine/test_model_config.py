"""Family fields read from HF config.json: windows per layer (transformers 5's layer_types, or
the family's rule in older configs), Phi-3's longrope context cap and its refusal."""

from __future__ import annotations

import json
import math

import pytest

from engine.models.config import from_hf_config

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2)


def _config(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(BASE | fields))
    return from_hf_config(tmp_path)


def test_windows_from_older_configs_follow_each_family(tmp_path):
    assert _config(tmp_path, model_type="mistral", sliding_window=8).layer_windows == (8,) * 6
    assert _config(tmp_path, model_type="mistral", sliding_window=None).layer_windows == ()
    # Qwen2 sets a window in its config but uses it only with use_sliding_window
    assert _config(tmp_path, model_type="qwen2", sliding_window=8).layer_windows == ()
    qwen = _config(tmp_path, model_type="qwen2", sliding_window=8, use_sliding_window=True,
                   max_window_layers=4)
    assert qwen.layer_windows == (None,) * 4 + (8, 8)
    gemma2 = _config(tmp_path, model_type="gemma2", sliding_window=8, query_pre_attn_scalar=16)
    assert gemma2.layer_windows == (8, None) * 3 and gemma2.kv_window is None
    gemma3 = _config(tmp_path, model_type="gemma3_text", sliding_window=8,
                     query_pre_attn_scalar=16)
    assert gemma3.layer_windows == (8,) * 5 + (None,) and gemma3.local_rope_theta == 10000.0
    typed = _config(tmp_path, model_type="gemma3_text", sliding_window=8,
                    query_pre_attn_scalar=16, layer_types=["full_attention"] * 6)
    assert typed.layer_windows == ()


def test_phi3_longrope_caps_the_context_and_says_why(tmp_path):
    cfg = _config(tmp_path, model_type="phi3", max_position_embeddings=1024,
                  original_max_position_embeddings=256,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                "long_factor": [2.0] * 8})
    assert cfg.max_position_embeddings == 256
    assert "long factor" in cfg.context_limit_reason
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(256)))


def test_a_longer_context_than_phi3s_short_factor_is_refused(tmp_path, bundled_tokenizer_dir):
    from tiny_families import build_family

    from engine import LLM

    path = build_family("phi3", tmp_path / "phi3", bundled_tokenizer_dir)
    with pytest.raises(ValueError, match="max_model_len 300 exceeds.*256.*longrope"):
        LLM(model=str(path), max_model_len=300)


def test_unsupported_model_types_are_named(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        _config(tmp_path, model_type="gpt2")
