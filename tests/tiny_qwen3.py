"""A tiny random-weight Qwen3 that "thinks": transformers' Qwen3 classes (tests/tiny_families.py)
with the bundled tokenizer extended by `<think>` / `</think>` (plain added tokens, as Qwen3's
are) and a chat template with Qwen3's logic (`enable_thinking`, reasoning kept after the last
query). A random model never thinks by itself: tests force it (logit_bias, a grammar).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# NOTE: bump the suffix when the model, tokenizer or template changes (cached across runs)
CACHE = Path(tempfile.gettempdir()) / "pagedserve-test-tiny-qwen3-think-v1"
VOCAB = 49160  # the bundled 49152 + the two markers, padded (ids past the tokenizer: none)

# NOTE: Qwen3's template logic (Qwen/Qwen3-8B tokenizer_config.json), written out again
QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": \
<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}\
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}\
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}\
{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def build_tiny_qwen3(path: Path, tokenizer_dir: Path) -> Path:
    """Save the thinking Qwen3 (random weights, markers as added tokens) at `path`."""
    from tiny_families import build_family
    from transformers import AutoTokenizer

    build_family("qwen3", path, tokenizer_dir, vocab_size=VOCAB, tie_word_embeddings=False)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"])  # NOTE: not special: they stay in decoded text
    tok.chat_template = QWEN3_TEMPLATE
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab",
                              "merges")):
            f.unlink()
    tok.save_pretrained(path)
    return path


def tiny_qwen3_dir() -> Path:
    """The checkpoint, built on first use (a rename makes it appear whole)."""
    if (CACHE / "config.json").is_file():
        return CACHE
    from engine.tokenizer import tokenizer_dir
    from ipc.model_source import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=CACHE.parent))
    try:
        build_tiny_qwen3(tmp, tokenizer_dir(resolve_model(None)))
        os.replace(tmp, CACHE)
    except OSError:
        if not (CACHE / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CACHE
