"""An HTTP proxy in front of the test store that injects what moto cannot produce for real.

Why: S3 throttling (`503 SlowDown`) comes from a loaded AWS front end; moto never sends it. This proxy
answers the next N requests with S3's own SlowDown error (status, XML body, request id) and forwards
the rest byte for byte, so the client's real retry path runs against a real store behind it. It can
also be stopped (the listening socket closed: connections refused) and started again on its port.

Each forwarded request gets a connection of its own (`Connection: close` both ways), so a client's
pooled keep-alive connections can never bypass the next injection. Runs on an asyncio loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>FAULTPROXY0000001</RequestId></Error>"
)
SLOW_DOWN_RESPONSE = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nx-amz-request-id: FAULTPROXY0000001\r\nConnection: close\r\n\r\n" % len(SLOW_DOWN)
) + SLOW_DOWN
CHUNK = 64 << 10


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines if ":" in ln)}


def _with_close(head: bytes) -> bytes:
    """The same head with `Connection: close` in place of any Connection header."""
    lines = [ln for ln in head.split(b"\r\n") if ln and not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


class FaultProxy:
    """`http://127.0.0.1:port` -> `upstream`; `slow_down(n)` answers the next n requests with 503 SlowDown."""

    def __init__(self, upstream: str) -> None:
        u = urlparse(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.seen: list[str] = []  # every request line the proxy saw ("PUT /bucket/key?uploadId=..")
        self.injected = 0  # answered 503 SlowDown
        self._slow_down = 0
        self._lock = threading.Lock()
        self._server: asyncio.AbstractServer | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self.port = 0
        self.start()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> int:
        return len(self.seen)

    def slow_down(self, n: int) -> None:
        """Answer the next `n` requests with S3's 503 SlowDown."""
        with self._lock:
            self._slow_down = n

    def start(self) -> None:
        """Listen (again, on the same port)."""

        async def listen() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

        self._server = asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Close the listening socket: new connections are refused."""

        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
            self._server = None

    def close(self) -> None:
        async def cancel_handlers() -> None:  # a client's idle pooled connection still waits in one
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        self.stop()
        asyncio.run_coroutine_threadsafe(cancel_handlers(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # ---- one client connection: one request ---------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        with self._lock:
            self.seen.append(head.split(b"\r\n", 1)[0].decode("latin-1").rsplit(" ", 1)[0])
            inject = self._slow_down > 0
            if inject:
                self._slow_down -= 1
                self.injected += 1
        try:
            if inject:
                await self._refuse(head, reader, writer)
            else:
                await self._forward(head, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _refuse(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h = _headers(head)
        # Read a body the client is already sending (closing on unread bytes would reset the connection);
        # a client waiting for `100 Continue` sends nothing and gets the error straight away.
        if h.get("expect", "").lower() != "100-continue":
            await reader.readexactly(int(h.get("content-length", "0")))
        writer.write(SLOW_DOWN_RESPONSE)
        await writer.drain()

    async def _forward(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.up_host, self.up_port)
        try:
            await self._send(up_writer, _with_close(head))
            upload = asyncio.ensure_future(self._pipe_body(reader, up_writer))
            while True:  # interim 1xx heads pass as they are; the final head gets Connection: close
                resp = await up_reader.readuntil(b"\r\n\r\n")
                if not resp.startswith(b"HTTP/1.1 1"):
                    break
                writer.write(resp)
                await writer.drain()
            writer.write(_with_close(resp))
            while data := await up_reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
            upload.cancel()
        finally:
            up_writer.close()

    async def _pipe_body(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(CHUNK):
            await self._send(up_writer, data)

    @staticmethod
    async def _send(up_writer: asyncio.StreamWriter, data: bytes) -> None:
        up_writer.write(data)
        await up_writer.drain()
