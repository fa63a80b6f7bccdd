"""A real `ragcache serve` process for tests: started from this checkout with `--port 0` (the
server binds a free port of 127.0.0.1 before its engine starts and logs it; the port is read
back from its log, never picked here and released), waited for (`/health`), stopped with
SIGTERM (the graceful drain), its log kept. In-process apps get a socket that the test binds
and holds (`held_socket`, `serve_in_thread`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0
API_KEY_ENV = "RAGCACHE_API_KEY"
ADMIN_KEY_ENV = "RAGCACHE_ADMIN_KEY"


BOUND = re.compile(r"bound http://127\.0\.0\.1:(\d+); starting the engine")


@contextlib.contextmanager
def held_socket() -> Iterator[socket.socket]:
    """A socket bound to a free port of 127.0.0.1 and held for the block (so nobody else can
    take the port): hand it to a server, or use its port where one must be taken."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock
    finally:
        sock.close()


@contextlib.contextmanager
def serve_in_thread(app: Any, sock: socket.socket, **config: Any) -> Iterator[str]:
    """`app` under real uvicorn, in a thread, on the held `sock`; yields its URL once it
    listens, and stops it after the block."""
    import uvicorn

    port = sock.getsockname()[1]
    options = {"log_level": "error", **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class ServerProcess:
    """`python -m ragcache_core serve --model MODEL --port P ARGS...` as a child process."""

    def __init__(
        self,
        model: Path,
        args: Sequence[str],
        log: Path,
        api_key: str | None = None,
        *,
        admin_key: str | None = None,
        new_session: bool = False,
    ):
        """`new_session`: the server leads a process group of its own (with its engine and
        watchdog), so a test can kill all of them at once."""
        self._port: int | None = None
        self.api_key = api_key
        self.admin_key = admin_key
        self.log = log
        command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(model)]
        command += ["--host", "127.0.0.1", "--port", "0", *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        if admin_key is not None:
            command += ["--admin-key", admin_key]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop(API_KEY_ENV, None)
        env.pop(ADMIN_KEY_ENV, None)
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        """The port the server bound (read from its log; it binds before its engine starts,
        so `wait_ready` knows it within seconds)."""
        if self._port is None:
            found = BOUND.search(self.log.read_text(errors="replace"))
            if found is None:
                raise RuntimeError(f"the server has not bound its port yet:\n{self.tail()}")
            self._port = int(found.group(1))
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                self.port  # noqa: B018 (read from the log once it is there)
            except RuntimeError:
                time.sleep(0.2)
                continue
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (drain), then wait; SIGKILL if it hangs. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self._log_file.close()
        return int(self.process.returncode)

    def tail(self, lines: int = 40) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def admin_client(self, timeout: float = 120.0) -> httpx.Client:
        """A client with the key that opens the admin routes (the admin key, if any)."""
        key = self.admin_key or self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def stats(self) -> dict[str, Any]:
        with self.client() as http:
            response = http.get("/v1/cache/stats")
            response.raise_for_status()
            data: dict[str, Any] = response.json()
            return data


def started(
    model: Path,
    args: Sequence[str],
    log: Path,
    api_key: str | None = None,
    *,
    admin_key: str | None = None,
    wait: bool = True,
) -> Iterator[ServerProcess]:
    """A started server for a fixture (stopped and its log shown on failure). `wait=False`
    yields it while it boots, so a fixture can compute in-process references meanwhile and
    call `wait_ready` after (two engines at once for a while: the boot is mostly imports)."""
    server = ServerProcess(model, args, log, api_key, admin_key=admin_key)
    try:
        if wait:
            server.wait_ready()
        yield server
    finally:
        code = server.stop()
        if code not in (0, -signal.SIGTERM):
            print(f"server exit code {code}:\n{server.tail()}", file=sys.stderr)


def sse_data(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def assert_idle(server: ServerProcess, timeout_s: float = 15.0) -> dict[str, Any]:
    """Wait until nothing is in flight anywhere (server queue, admission, tree pins, open
    handles, vLLM's own requests); then the tree's integrity check must pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        busy = {
            "in_flight": stats["serve"]["in_flight"],
            "in_prefill": stats["in_prefill"],
            "queue_waiting": stats["queue_waiting"],
            "pinned_nodes": stats["tree"]["pinned_nodes"],
            "open_requests": stats["tree"]["open_requests"],
            "engine_requests": stats["engine_requests"],
        }
        if not any(busy.values()):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout_s} s: {busy}")
        time.sleep(0.2)
    with server.admin_client() as http:
        check = http.get("/v1/cache/integrity")
    assert check.status_code == 200, check.text
    return stats
