"""The Python SDK resumes a resumable stream when the network drops under it (a proxy that cuts
every connection and refuses new ones for two seconds): the text is the uninterrupted run's,
stitched once, from one generation."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pagedserve_client as ps
import pytest
from resume_support import GRACE, CuttingProxy, finished_total, metric_value, metrics_text, wait_for
from tiny_server import MODEL_NAME, running_server, wait_idle

ENGINE = f'model_name="{MODEL_NAME}"'
MESSAGES = [{"role": "user", "content": "Tell a long story"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server("--stream-grace-period", str(GRACE)) as base:
        yield base


@pytest.fixture
def proxy(url: str) -> Iterator[CuttingProxy]:
    p = CuttingProxy(urlsplit(url).port or 0)
    yield p
    p.close()


def _params(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}


def _reference(url: str, max_tokens: int) -> str:
    with ps.Client(url) as client, client.chat.completions.create(**_params(max_tokens)) as s:
        return "".join(chunk.text for chunk in s)


def _counters(url: str) -> tuple[float, float, float]:
    text = metrics_text(url)
    return (metric_value(text, "vllm:prompt_tokens_total", ENGINE),
            metric_value(text, "vllm:generation_tokens_total", ENGINE), finished_total(text))


def _check_one_run(url: str, before: tuple[float, float, float], prompt_tokens: int,
                   max_tokens: int) -> None:
    wait_for(lambda: _counters(url)[1] >= before[1] + max_tokens, 30, "the engine's counters")
    after = _counters(url)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == \
        (prompt_tokens, max_tokens, 1)  # one prefill, one request


def test_sync_stream_resumes_after_a_network_cut(url: str, proxy: CuttingProxy) -> None:
    # NOTE: long enough that events are still coming when the network is cut
    reference = _reference(url, 300)
    wait_idle(url)
    before = _counters(url)
    texts, usage = [], None
    with ps.Client(proxy.url) as client:
        stream = client.chat.completions.create(**_params(
            300, resumable=True, cache_salt=uuid.uuid4().hex,
            stream_options={"include_usage": True}))
        with stream:
            for i, chunk in enumerate(stream):
                texts.append(chunk.text)
                usage = chunk.usage or usage
                if i == 4:
                    proxy.cut(down_for=2.0)
    assert proxy.cuts == 1 and stream.resumes >= 1 and stream.stream_id
    assert "".join(texts) == reference and reference
    assert usage is not None
    _check_one_run(url, before, usage.prompt_tokens, 300)


async def test_async_stream_resumes_after_a_network_cut(url: str, proxy: CuttingProxy) -> None:
    reference = _reference(url, 300)
    texts = []
    async with ps.AsyncClient(proxy.url) as client:
        stream = await client.chat.completions.create(**_params(300, resumable=True))
        async with stream:
            i = 0
            async for chunk in stream:
                texts.append(chunk.text)
                i += 1
                if i == 3:
                    proxy.cut(down_for=2.0)
    assert stream.resumes >= 1
    assert "".join(texts) == reference


def test_closing_a_resumable_stream_cancels_it(url: str) -> None:
    text = metrics_text(url)
    aborts0 = metric_value(text, "pagedserve_requests_total", 'finish_reason="abort"')
    expired0 = metric_value(text, "pagedserve_streams_expired_aborted_total")
    with ps.Client(url) as client:
        stream = client.chat.completions.create(**_params(4000, resumable=True))
        with stream:
            next(iter(stream))
    wait_for(lambda: metric_value(metrics_text(url), "pagedserve_requests_total",
                                  'finish_reason="abort"') > aborts0, 30, "the abort")
    # NOTE: aborted by the SDK's DELETE, not by the grace period running out
    assert metric_value(metrics_text(url), "pagedserve_streams_expired_aborted_total") == expired0


def test_expired_stream_raises_a_typed_error(url: str, proxy: CuttingProxy) -> None:
    with ps.Client(proxy.url, max_retries=0) as client:
        stream = client.chat.completions.create(**_params(4000, resumable=True))
        chunks = iter(stream)
        next(chunks)
        proxy.cut(down_for=GRACE + 3)  # longer than the grace period
        with pytest.raises(ps.APIStatusError) as info:
            for _ in chunks:
                pass
        stream.close()
    assert info.value.status_code == 410 and info.value.code == "stream_expired"


async def test_websocket_client_resumes_after_a_network_cut(url: str,
                                                            proxy: CuttingProxy) -> None:
    reference = _reference(url, 300)
    async with ps.AsyncClient(proxy.url) as client, client.websocket() as ws:
        gen = await ws.generate(**{k: v for k, v in _params(300, resumable=True).items()
                                   if k != "stream"})
        texts = []
        async for chunk in gen:
            texts.append(chunk.text)
            if len(texts) == 3:
                proxy.cut(down_for=2.0)
        assert gen.stream_id and ws.reconnects == 1 and proxy.cuts == 1
        assert gen.done is not None and gen.done.status == ps.GenerationStatus.COMPLETED
    assert "".join(texts) == reference
