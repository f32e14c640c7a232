"""A WebSocket reader that stops reading (its TCP window fills): its deltas coalesce, then its
outbox overflows and the session closes 1013 and ends its generations at once, while a send to
it is still blocked; other clients are unaffected. The app runs under uvicorn with the scripted
engine (the tiny model cannot fill 1 MiB of frames fast enough); the slow client is a raw
socket."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest
import websockets
from gateway_fakes import FakeEngine, serve

from gateway.app import build_app
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.timeout(60)
# NOTE: the server's close frame: opcode 8, 17 bytes (code 1013 and "reader too slow")
CLOSE_1013 = b"\x88\x11" + struct.pack("!H", 1013) + b"reader too slow"
REQUEST = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000}


def masked_text_frame(text: str) -> bytes:
    data, mask = text.encode(), os.urandom(4)
    size = bytes([0x80 | len(data)]) if len(data) < 126 else bytes([0xFE]) + struct.pack(
        "!H", len(data))
    return b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each unmasked server frame in `data`."""
    frames, i = [], 0
    while i + 2 <= len(data):  # NOTE: the data ends with a whole close frame
        opcode, size, i = data[i] & 0x0F, data[i + 1] & 0x7F, i + 2
        if size == 126:
            size, i = struct.unpack("!H", data[i:i + 2])[0], i + 2
        elif size == 127:
            size, i = struct.unpack("!Q", data[i:i + 8])[0], i + 8
        frames.append((opcode, data[i:i + size]))
        i += size
    return frames


class SlowReader:
    """A WebSocket client on a raw socket with a tiny receive buffer that reads nothing."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Protocol: pagedserve.v1\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101")
        self.sock.settimeout(0.05)
        self.received = bytearray()

    def generate(self, gen_id: str) -> None:
        self.sock.sendall(masked_text_frame(json.dumps(
            {"type": "generate", "id": gen_id, "request": REQUEST})))

    def read_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.received += self.sock.recv(1 << 20)
            except TimeoutError:
                continue

    def read_to_end(self) -> bytes:
        """Read until the server closes; answer its close frame, as a WebSocket client does
        (else the server waits out its close timeout, 10 s, for the closing handshake)."""
        self.sock.settimeout(10)
        answered = False
        while chunk := self.sock.recv(1 << 20):
            self.received += chunk
            if not answered and CLOSE_1013 in self.received:
                mask = os.urandom(4)
                code = struct.pack("!H", 1013)
                self.sock.sendall(b"\x88\x82" + mask + bytes(b ^ mask[i] for i, b in
                                                            enumerate(code)))
                answered = True
        self.sock.close()
        return bytes(self.received)


async def test_slow_reader_is_closed_1013_and_others_are_unaffected(
        bundled_tokenizer_dir: Path) -> None:
    # NOTE: about 20 s per generation: they still run, and the sender is stuck, at the overflow
    engine = FakeEngine(bundled_tokenizer_dir, reply="word " * 20000, interval=0.001,
                        max_model_len=30000)
    app = build_app(engine, GatewaySettings(ws_send_queue=8))
    async with serve(app, send_buffer=4096) as url:
        slow = await asyncio.to_thread(SlowReader, int(url.rsplit(":", 1)[1]))
        for i in range(3):
            await asyncio.to_thread(slow.generate, f"g{i}")
        await asyncio.sleep(3.0)  # NOTE: the socket's buffers fill up; deltas coalesce
        await asyncio.to_thread(slow.read_for, 0.5)  # NOTE: the coalesced deltas go out
        await asyncio.sleep(2.0)  # NOTE: full again
        for i in range(3, 12):  # NOTE: more frames than ws_send_queue: the outbox overflows
            await asyncio.to_thread(slow.generate, f"g{i}")

        async with websockets.connect(url.replace("http", "ws") + "/v1/ws",
                                      subprotocols=["pagedserve.v1"]) as ws:
            await ws.recv()
            request = {**REQUEST, "max_tokens": 20}
            await ws.send(json.dumps({"type": "generate", "id": "ok", "request": request}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] != (
                    "generation.done"):
                pass
            assert frame["status"] == "completed"

        # NOTE: the reader still reads nothing: its generations end anyway, well before
        # uvicorn's keepalive ping (20 s + 20 s) would cut it
        gw = app.state.gateway
        for _ in range(100):
            if not gw.generations and engine.num_inflight == 0:
                break
            await asyncio.sleep(0.05)
        assert not gw.generations and engine.num_inflight == 0, "generations still run"
        data = await asyncio.to_thread(slow.read_to_end)
        frames = server_frames(data)
        texts = [json.loads(p) for op, p in frames if op == 1]
        assert any(len(f["chunk"]["choices"][0]["delta"].get("content", "")) > 5 for f in texts
                   if f["type"] == "generation.delta"), "coalesced deltas carry many tokens"
        opcode, payload = frames[-1]
        assert opcode == 8 and struct.unpack("!H", payload[:2])[0] == 1013
