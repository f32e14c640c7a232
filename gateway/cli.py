"""`pagedserve` command line: `serve` (gateway + spawned engine), `engine` and `generate`.

`serve` parses and checks its flags, spawns its engines, and only then imports the web stack
(gateway/serving.py: the HTTP server, the drain, sd_notify), in a thread while the engines
import torch and load: their starts overlap instead of adding up. This module therefore
imports only what parsing and spawning need.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.model_args import add_model_args, check_model_args, engines_for
from gateway.reasoning import REASONING_PARSERS
from gateway.settings import GatewaySettings, StreamLimits
from gateway.tools.registry import PARSERS
from ipc import exit_codes
from ipc.config import EngineConfig, add_engine_args, config_from_args
from ipc.engine_timeouts import EngineTimeouts
from ipc.transport import check_runtime_dir

_EXEC_MODULES = {"engine": "engine", "generate": "engine.generate"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="start the gateway and an engine process",
        formatter_class=_DefaultsOnceFormatter, conflict_handler="resolve",
    )
    group = serve.add_argument_group("gateway")
    _add_http_args(group)
    _add_reply_args(group)
    _add_stream_args(serve)
    _add_engine_process_args(serve)
    add_engine_args(serve)
    add_model_args(serve)  # NOTE: after the engine's: its repeatable --model replaces theirs
    commands.add_parser("engine", help="run one engine process (python -m engine ...)",
                        add_help=False)
    commands.add_parser("generate", help="generate offline (python -m engine.generate ...)",
                        add_help=False)
    return parser


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    """The gateway's listening, admission, body and timeout flags."""
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                       help="require `Authorization: Bearer <key>` on /v1 "
                            "(default: $PAGEDSERVE_API_KEY, else no auth)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(also on with $VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    group.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 + Retry-After beyond this many requests the engine "
                            "has not scheduled yet (its queue, plus those on their way to it)")
    group.add_argument("--allowed-origins", default="",
                       help="comma-separated CORS and WebSocket origins ('*' for any); "
                            "empty: same-origin WebSockets only, no CORS")
    group.add_argument("--max-body-bytes", type=int, default=GatewaySettings.max_body_bytes,
                       help="largest request body and WebSocket frame accepted (413 and close "
                            "1009 beyond)")
    group.add_argument("--sse-keepalive-interval", type=float,
                       default=GatewaySettings.sse_keepalive_interval,
                       help="send an SSE `: ping` comment after this many seconds without an "
                            "event (for proxies that cut idle streams); default: never, as "
                            "OpenAI and vLLM (`vllm bench serve` mis-parses lone comments)")
    group.add_argument("--header-timeout", type=float, default=GatewaySettings.header_timeout,
                       help="seconds a client has to send a request's line and headers "
                            "(the connection is closed after)")
    group.add_argument("--body-timeout", type=float, default=GatewaySettings.body_timeout,
                       help="seconds a client has to send a request's whole body once its "
                            "headers are in (408, then the connection is closed)")
    group.add_argument("--split-special-tokens", action="store_true",
                       help="encode special-token strings (such as <|im_start|>) in client text "
                            "(message contents, prompts) as plain text; by default they become "
                            "control tokens, as in HF transformers")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may finish after SIGTERM before abort")
    group.add_argument("--log-level", default="info", help="gateway log level")


def _add_reply_args(group: argparse._ArgumentGroup) -> None:
    """How the gateway renders prompts and splits replies (templates, tools, reasoning,
    stored responses) and where it sends traces."""
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template for /v1/chat/completions, instead of the "
                            "model's own (models without one answer chat requests with 400)")
    group.add_argument("--otlp-traces-endpoint",
                       default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                       help="OTLP/HTTP collector URL (e.g. http://127.0.0.1:4318): one span per "
                            "request; needs pip install 'pagedserve[otel]' "
                            "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)")
    group.add_argument("--tool-call-parser", default=GatewaySettings.tool_call_parser,
                       choices=PARSERS,
                       help="how replies are split into content and tool calls: hermes "
                            "(<tool_call>{...}</tool_call>), llama3_json ({\"name\", "
                            "\"parameters\"}; ...), mistral ([TOOL_CALLS] [{...}]); auto picks "
                            "the chat template's format, hermes without a tools branch "
                            "(default: auto)")
    group.add_argument("--responses-store-mib", type=int,
                       default=GatewaySettings.responses_store_mib,
                       help="memory for stored /v1/responses (store: true), oldest evicted "
                            "first; 0 keeps none (previous_response_id then finds none)")
    group.add_argument("--responses-store-ttl", type=float,
                       default=GatewaySettings.responses_store_ttl,
                       help="seconds a stored response is kept (GET, previous_response_id)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split chat replies into reasoning (`reasoning_content`) and "
                            "answer: deepseek_r1 (text before </think>), qwen3 (inside "
                            "<think>...</think>), deepseek_v3 (as deepseek_r1 when the request "
                            "asks `thinking`), mistral ([THINK]...[/THINK]) (default: off)")


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" to help that does not speak of its default already, and not
    "(default: None)": an unset flag's help says what then happens."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("default" in action.help.lower() or action.default is None):
            return action.help
        return super()._get_help_string(action)


def _add_stream_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("resumable streams (docs/resume.md)")
    group.add_argument("--resumable-streams", action="store_true",
                       help="make every SSE and WebSocket stream resumable unless its request "
                            "says `resumable: false` (by default only those that say `true`); "
                            "its events then carry `id:` lines, which `vllm bench serve` cannot "
                            "parse")
    group.add_argument("--stream-grace-period", type=float, default=StreamLimits.grace_period,
                       help="seconds a resumable stream's generation runs on with no reader "
                            "before it is aborted and its KV freed")
    group.add_argument("--stream-buffer-bytes", type=int, default=StreamLimits.max_stream_bytes,
                       help="event bytes a resumable stream keeps for a reconnect (oldest "
                            "dropped first)")
    group.add_argument("--stream-buffer-age", type=float, default=StreamLimits.max_event_age,
                       help="seconds a resumable stream keeps an event for a reconnect")
    group.add_argument("--stream-buffer-total-bytes", type=int,
                       default=StreamLimits.max_total_bytes,
                       help="event bytes kept over all resumable streams (the largest buffer "
                            "drops first)")


def _add_engine_process_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine process")
    group.add_argument("--attach-engine", action="store_true",
                       help="spawn no engine: wait for one started elsewhere (for example "
                            "pagedserve-engine@.service) to connect to the addresses below")
    group.add_argument("--engine-input-addr", default=os.environ.get("PAGEDSERVE_ENGINE_INPUT"),
                       help="ROUTER address engines connect to (default: $PAGEDSERVE_ENGINE_INPUT,"
                            " else a fresh ipc:// socket in the runtime directory)")
    group.add_argument("--engine-output-addr",
                       default=os.environ.get("PAGEDSERVE_ENGINE_OUTPUT"),
                       help="PULL address engines send outputs to (default: "
                            "$PAGEDSERVE_ENGINE_OUTPUT, else a fresh ipc:// socket)")
    group.add_argument("--engine-heartbeat-timeout", type=float,
                       default=EngineTimeouts.heartbeat_timeout,
                       help="seconds without a heartbeat before the engine is declared dead")
    group.add_argument("--engine-startup-timeout", type=float,
                       default=EngineTimeouts.startup_timeout,
                       help="seconds the first engine may take to become ready")
    group.add_argument("--headless", action="store_true",
                       help="run only this node's tensor-parallel ranks (--node-rank 1 and "
                            "up), no gateway and no scheduler: they join node 0's engine at "
                            "--master-addr:--master-port (docs/scale-out.md)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engines (each with its own KV cache) behind this gateway, routed "
                            "by prefix cache then load; with --attach-engine, > 1 adopts every "
                            "engine that connects (see docs/scale-out.md)")


def check_args(ns: argparse.Namespace) -> EngineConfig:
    """Validate what argparse cannot; returns the engine config (ValueError names the flag)."""
    check_model_args(ns)  # NOTE: sets ns.model_specs, and ns.model back to one path
    if not 0 <= ns.port <= 65535:  # NOTE: the socket layer would wrap 99999 to 34463
        raise ValueError(f"--port must be 0-65535, not {ns.port}")
    if ns.max_queued_requests is not None and ns.max_queued_requests < 1:
        raise ValueError("--max-queued-requests must be >= 1")
    if ns.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    for flag in ("header_timeout", "body_timeout"):
        if getattr(ns, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    for flag in ("engine_heartbeat_timeout", "engine_startup_timeout"):
        if getattr(ns, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    if ns.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if ns.node_rank > 0 and not ns.headless:
        raise ValueError("--node-rank > 0 runs only tensor-parallel ranks: add --headless (node "
                         "0 runs the gateway and the engine)")
    if ns.nnodes > 1 and ns.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 does not combine with --nnodes > 1: the "
                         "engines would share one --master-port")
    if ns.attach_engine and not (ns.engine_input_addr and ns.engine_output_addr):
        raise ValueError("--attach-engine needs --engine-input-addr and --engine-output-addr")
    if not ns.headless and not (ns.engine_input_addr and ns.engine_output_addr):
        check_runtime_dir()  # NOTE: the default ipc:// addresses must fit a socket's path
    if ns.chat_template is not None and not Path(ns.chat_template).is_file():
        raise ValueError(f"--chat-template {ns.chat_template!r} is not a file")
    settings_from_args(ns)  # NOTE: GatewaySettings validates its own fields (ValueError)
    if ns.otlp_traces_endpoint:
        from gateway.tracing import traces_url  # NOTE: lazy, as the web stack it imports

        traces_url(ns.otlp_traces_endpoint)
        if importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError("--otlp-traces-endpoint needs the OpenTelemetry SDK: "
                             "pip install 'pagedserve[otel]'")
    config = config_from_args(ns)
    if ns.headless:
        config.check_headless()
    return config


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _EXEC_MODULES:
        # NOTE: exec keeps the gateway's process free of torch; the engine owns its own argv.
        module = _EXEC_MODULES[args[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *args[1:]])
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        config = check_args(ns)
    except ValueError as exc:
        parser.exit(exit_codes.CONFIG_ERROR, f"pagedserve: error: {exc}\n")
    if ns.headless:  # NOTE: no gateway here: exec the node's ranks, as `engine` is exec'd
        os.execv(sys.executable, [sys.executable, "-m", "engine.parallel.headless",
                                  *config.to_cli_args()])
    # NOTE: the engine clients log through logging; gateway/serving.py adds structlog's setup
    logging.basicConfig(level=logging.getLevelName(ns.log_level.upper()), format="%(message)s",
                        stream=sys.stderr)
    import uvloop

    sys.exit(uvloop.run(_serve(ns)))


async def _serve(ns: argparse.Namespace) -> int:
    """Spawn the engines, import the web stack while they start, then serve."""
    client = engines_for(ns)
    starting = asyncio.ensure_future(client.start())
    try:
        # NOTE: in a thread, so that this loop goes on spawning (one task level per pool or
        # model) and answering the engines while the import runs
        serving = await asyncio.get_running_loop().run_in_executor(
            None, importlib.import_module, "gateway.serving")
    except BaseException:  # NOTE: no engine left running behind a gateway that never served
        starting.cancel()
        await client.close(timeout=0)
        raise
    return await serving.serve(ns, settings_from_args(ns), client, starting)


def settings_from_args(ns: argparse.Namespace) -> GatewaySettings:
    origins = tuple(o.strip() for o in ns.allowed_origins.split(",") if o.strip())
    return GatewaySettings(
        api_key=ns.api_key or None, max_queued_requests=ns.max_queued_requests,
        enable_lora=ns.enable_lora, lora_modules=tuple(ns.lora_modules),
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
        allowed_origins=origins, max_body_bytes=ns.max_body_bytes,
        otlp_traces_endpoint=ns.otlp_traces_endpoint or None,
        sse_keepalive_interval=ns.sse_keepalive_interval,
        split_special_tokens=ns.split_special_tokens, header_timeout=ns.header_timeout,
        body_timeout=ns.body_timeout,
        chat_template=Path(ns.chat_template).read_text() if ns.chat_template else None,
        tool_call_parser=ns.tool_call_parser,
        responses_store_mib=ns.responses_store_mib, responses_store_ttl=ns.responses_store_ttl,
        reasoning_parser=ns.reasoning_parser, resumable_streams=ns.resumable_streams,
        model_management=ns.enable_model_management,
        stream_limits=StreamLimits(grace_period=ns.stream_grace_period,
                                   max_stream_bytes=ns.stream_buffer_bytes,
                                   max_event_age=ns.stream_buffer_age,
                                   max_total_bytes=ns.stream_buffer_total_bytes),
    )


if __name__ == "__main__":
    main()
