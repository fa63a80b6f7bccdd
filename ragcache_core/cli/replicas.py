"""`ragcache replicas`: N `ragcache serve` processes and vllm-router in front of them, on one
machine, for tests and trials (docs/deploy.md, "Many replicas").

    ragcache replicas --model DIR --replicas 2 [--port 8000] [--base-port 8001]
        [--gpus 0,1] [--router-policy consistent_hash] [--log-dir DIR] -- [serve options]

0. Every port is bound here first (`hold_ports`): the replicas' (BASE+i, or any free port with
   `--base-port 0`), the router's and its metrics' (0: any free one). A taken port is one line
   that names it, before any engine starts. Each replica's socket is handed to it as an
   inherited file descriptor (`ragcache serve --fd`), so its port is never free in between; the
   router's two are let go just before the router binds them itself.
1. Replica i: `ragcache serve --fd <its socket> --replica-id r<i> --peers <the others>` plus
   the serve options after `--` (cache sizes, --index, keys), with
   `CUDA_VISIBLE_DEVICES=<gpus[i]>` when `--gpus` is given.
2. Wait until every replica's `/health` is 200 (vllm-router counts a worker it never probed as
   healthy).
3. vllm-router (`--router`, `$RAGCACHE_VLLM_ROUTER`, or `vllm-router` on PATH or next to this
   Python) on HOST:PORT with the flags `router_command` lists, then wait for its `/readiness`.
4. Run until SIGINT/SIGTERM or the router's exit: the router is stopped first, then every
   replica gets SIGTERM (each drains), then SIGKILL after `--stop-timeout`. A replica that
   dies meanwhile is reported and left dead: the router routes around it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ragcache_core.errors import CliError, ConfigError
from ragcache_core.serve.listen import bind_socket, bound_port

ROUTER_ENV = "RAGCACHE_VLLM_ROUTER"
ROUTER_VERSION = "0.1.17"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replicas",
        help="start N ragcache serve replicas and vllm-router in front of them (one machine)",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
    )
    p.add_argument("--model", type=Path, required=True, metavar="DIR")
    p.add_argument("--replicas", type=int, default=2, metavar="N")
    p.add_argument("--host", default="127.0.0.1", help="router and replicas (%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the router's (%(default)s; 0: any)")
    p.add_argument(
        "--base-port", type=int, default=8001, help="replica i: BASE+i (%(default)s; 0: any)"
    )
    p.add_argument("--gpus", default=None, help="comma list: replica i sees GPU gpus[i]")
    p.add_argument(
        "--router-policy",
        default="consistent_hash",
        help="vllm-router --policy (%(default)s: document affinity on X-Session-Id)",
    )
    p.add_argument("--router", default=None, help=f"the vllm-router binary (${ROUTER_ENV})")
    p.add_argument(
        "--prometheus-port", type=int, default=29000, help="the router's metrics (0: any)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RAGCACHE_API_KEY"),
        help="the replicas' API key; the router sends it on RAGCache's own routes",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="one log file per process")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds (%(default)s)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds (%(default)s)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then ragcache serve options")
    p.set_defaults(func=_run)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where everything listens."""

    host: str
    port: int
    replica_ports: tuple[int, ...]

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def replica_urls(self) -> tuple[str, ...]:
        return tuple(f"http://{self.host}:{p}" for p in self.replica_ports)


@dataclass(frozen=True, slots=True)
class HeldPorts:
    """Every port of a layout, bound now and held: the replicas' sockets (each handed to its
    replica, `serve_command(..., fd=)`, then `release_replicas`: a replica's port must close
    when the replica dies, so that the router is refused there, not left waiting) and the
    router's and its metrics' (`release_router` just before the router starts: it binds them
    itself)."""

    layout: Layout
    prometheus_port: int
    replica_sockets: tuple[socket.socket, ...]
    router_sockets: tuple[socket.socket, ...]

    def release_replicas(self) -> None:
        """Close this process's copies of the replicas' sockets (once each replica has its own)."""
        for sock in self.replica_sockets:
            sock.close()

    def release_router(self) -> None:
        for sock in self.router_sockets:
            sock.close()

    def close(self) -> None:
        for sock in (*self.replica_sockets, *self.router_sockets):
            sock.close()


def hold_ports(
    host: str, port: int, base_port: int, replicas: int, prometheus_port: int
) -> HeldPorts:
    """Bind every port `ragcache replicas` needs (0: any free port; replica i gets BASE+i,
    or any free port for BASE 0); `ConfigError` naming the first taken port, with nothing
    left bound, or naming a port asked for twice."""
    wanted = [base_port + i for i in range(replicas)] if base_port else []
    wanted += [p for p in (port, prometheus_port) if p]
    clash = sorted({p for p in wanted if wanted.count(p) > 1})
    if clash:
        raise ConfigError(
            f"port {clash[0]} is asked for twice (--port, --prometheus-port and --base-port + i "
            "for each replica must differ)"
        )
    held: list[socket.socket] = []
    try:
        for i in range(replicas):
            want = base_port + i if base_port else 0
            held.append(bind_socket(host, want, what=f"--base-port + {i} (replica {i}'s port)"))
        held.append(bind_socket(host, port, what="--port"))
        held.append(bind_socket(host, prometheus_port, what="--prometheus-port"))
    except BaseException:
        for sock in held:
            sock.close()
        raise
    ports = [bound_port(sock) for sock in held]
    layout = Layout(host, ports[replicas], tuple(ports[:replicas]))
    return HeldPorts(layout, ports[-1], tuple(held[:replicas]), tuple(held[replicas:]))


def find_router(given: str | None) -> str:
    """The vllm-router binary, or `CliError` saying how to install it."""
    candidates = [given, os.environ.get(ROUTER_ENV), shutil.which("vllm-router")]
    candidates.append(str(Path(sys.executable).parent / "vllm-router"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise CliError(
        f"vllm-router not found (--router, ${ROUTER_ENV}, PATH): "
        f"pip install 'vllm-router=={ROUTER_VERSION}' (or ragcache[replicas])"
    )


def serve_command(
    layout: Layout,
    i: int,
    model: Path,
    api_key: str | None,
    extra: Sequence[str],
    *,
    fd: int | None = None,
) -> list[str]:
    """Replica i's command: on its socket `fd` (inherited: pass it in `pass_fds`), else on
    its port of `layout`."""
    peers = [u for j, u in enumerate(layout.replica_urls) if j != i]
    cmd = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(model)]
    if fd is None:
        cmd += ["--host", layout.host, "--port", str(layout.replica_ports[i])]
    else:
        cmd += ["--fd", str(fd)]
    cmd += ["--replica-id", f"r{i}"]
    if peers:
        cmd += ["--peers", *peers]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra)


def router_command(
    binary: str, layout: Layout, policy: str, prometheus_port: int, api_key: str | None
) -> list[str]:
    """vllm-router with the flags docs/deploy.md explains: health every 2 s (2 failures take
    a replica out, 2 successes bring it back), no retries (under consistent_hash a retry hits
    the same replica; RAGCacheClient retries 429 itself), a breaker of 5 failures."""
    cmd = [binary, "--host", layout.host, "--port", str(layout.port)]
    cmd += ["--worker-urls", *layout.replica_urls, "--policy", policy]
    cmd += ["--health-check-endpoint", "/health", "--health-check-interval-secs", "2"]
    cmd += ["--health-failure-threshold", "2", "--health-success-threshold", "2"]
    cmd += ["--health-check-timeout-secs", "2", "--worker-startup-timeout-secs", "120"]
    cmd += ["--worker-startup-check-interval", "1", "--disable-retries"]
    cmd += ["--cb-failure-threshold", "5", "--cb-timeout-duration-secs", "10"]
    cmd += ["--request-timeout-secs", "1800", "--prometheus-host", layout.host]
    cmd += ["--prometheus-port", str(prometheus_port), "--log-level", "warning"]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def wait_for(
    url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float, stopping: list[int]
) -> None:
    """Until GET `url` answers 200; `CliError` if a process in `procs` exits, a signal came
    (`stopping`) or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopping:
            raise CliError(f"stopped by signal {stopping[0]} while waiting for {url}")
        for proc in procs:
            if proc.poll() is not None:
                raise CliError(
                    f"process {proc.pid} exited ({proc.returncode}) before {url} answered "
                    "(see its log, --log-dir)"
                )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise CliError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def spawn(
    cmd: list[str], env: dict[str, str], log: IO[bytes] | None, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """`cmd` as a child process, its output (stderr too) to `log` (None: this terminal)."""
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None, pass_fds=pass_fds
    )


def start_replicas(
    held: HeldPorts,
    model: Path,
    api_key: str | None,
    extra: Sequence[str],
    procs: list[subprocess.Popen[bytes]],
    *,
    env_for: Callable[[int], dict[str, str]],
    log_for: Callable[[int], IO[bytes] | None],
) -> None:
    """Start replica i of `held` on its held socket (inherited), with `env_for(i)` and its
    output to `log_for(i)`. Each is appended to `procs` as it starts, so that the caller's
    `finally` stops what did start; then this process lets its copies of the sockets go."""
    for i, sock in enumerate(held.replica_sockets):
        fd = sock.fileno()
        cmd = serve_command(held.layout, i, model, api_key, extra, fd=fd)
        procs.append(spawn(cmd, env_for(i), log_for(i), (fd,)))
    held.release_replicas()  # each replica holds its own now


def _log(log_dir: Path | None, name: str) -> IO[bytes] | None:
    if log_dir is None:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    return (log_dir / f"{name}.log").open("ab")


def stop(
    routers: Sequence[subprocess.Popen[bytes]],
    replicas: list[subprocess.Popen[bytes]],
    timeout_s: float,
) -> None:
    """The routers first, then SIGTERM to every replica (they drain), SIGKILL after
    `timeout_s`."""
    for router in routers:
        if router.poll() is None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
    for proc in replicas:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in replicas:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise CliError(f"--replicas must be >= 1, got {args.replicas}")
    extra = [a for a in args.serve_args if a != "--"]
    for forbidden in ("--host", "--port", "--fd", "--replica-id", "--peers", "--api-key"):
        if forbidden in extra:
            raise CliError(f"{forbidden} is set by ragcache replicas; drop it after --")
    gpus = args.gpus.split(",") if args.gpus else None
    if gpus is not None and len(gpus) < args.replicas:
        raise CliError(f"--gpus lists {len(gpus)} GPU(s) for {args.replicas} replicas")
    binary = find_router(args.router)
    held = hold_ports(args.host, args.port, args.base_port, args.replicas, args.prometheus_port)
    layout = held.layout
    replicas: list[subprocess.Popen[bytes]] = []
    router: subprocess.Popen[bytes] | None = None
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def env_for(i: int) -> dict[str, str]:
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        return env

    try:
        start_replicas(
            held,
            args.model,
            args.api_key,
            extra,
            replicas,
            env_for=env_for,
            log_for=lambda i: _log(args.log_dir, f"replica-{i}"),
        )
        for url in layout.replica_urls:
            wait_for(url + "/health", replicas, args.startup_timeout, stopping)
        cmd = router_command(binary, layout, args.router_policy, held.prometheus_port, args.api_key)
        held.release_router()
        router = spawn(cmd, dict(os.environ), _log(args.log_dir, "router"))
        wait_for(layout.router_url + "/readiness", [router], 60.0, stopping)
        print(
            f"ready: router {layout.router_url} ({args.router_policy}) -> "
            + ", ".join(
                f"r{i} {u} (pid {p.pid})"
                for i, (u, p) in enumerate(zip(layout.replica_urls, replicas, strict=True))
            ),
            flush=True,
        )
        _supervise(router, replicas, stopping)
    finally:
        held.close()
        stop([router] if router is not None else [], replicas, args.stop_timeout)
    return 0 if stopping else 1


def _supervise(
    router: subprocess.Popen[bytes], replicas: list[subprocess.Popen[bytes]], stopping: list[int]
) -> None:
    """Until a signal or the router's exit; a replica's death is reported once."""
    reported: set[int] = set()
    while not stopping and router.poll() is None:
        for i, proc in enumerate(replicas):
            if proc.poll() is not None and i not in reported:
                reported.add(i)
                print(f"replica r{i} exited ({proc.returncode}); the router routes around it")
        time.sleep(0.5)
