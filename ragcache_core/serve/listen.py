"""The listening socket, bound before anything else starts.

A server binds its port first and holds it through the engine's start (half a minute on a
CPU), as `vllm serve` does for the same race (vllm/entrypoints/launchers/launcher.py, vLLM
issue 8204): a port that another program holds fails at once, in one line that names it, and
no other program can take the port while the engine starts. The socket listens at once: on
Linux a socket that is only bound can be bound again by any other program that also sets
SO_REUSEADDR (uvicorn does), a listening one cannot. uvicorn gets it (`Server.run(sockets=...)`)
and accepts on it once the app's lifespan has built the engine; until then a connection waits
in the kernel's backlog (a probe with a timeout sees a timeout), never answered by someone
else.

Port 0 binds any free port: `bound_port` says which. A supervisor (`ragcache replicas`) binds
its replicas' sockets itself and hands each one down as an inherited file descriptor
(`adopt_socket`), so their ports are held from the first moment too.

Light on purpose (no FastAPI, no uvicorn): the command line imports it to check ports.
"""

from __future__ import annotations

import errno
import socket

from ragcache_core.errors import ConfigError

BACKLOG = 2048
"""uvicorn's default backlog."""


def bind_socket(host: str, port: int, *, what: str = "--port") -> socket.socket:
    """A TCP socket bound to `host:port` and listening, as uvicorn binds one (SO_REUSEADDR;
    IPv6 when `host` has a colon). Not inheritable, and vLLM spawns its engine processes
    (never forks: `runtime/main_guard.vllm_spawns`), so they never hold the port.
    `ConfigError` naming the port (and `what` sets it) if it cannot be bound."""
    if not 0 <= port < 65536:
        raise ConfigError(f"{what} {port}: a port is 0-65535 (0: any free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)  # (only a listening socket is exclusive: see above)
    except socket.gaierror as exc:
        sock.close()
        raise ConfigError(
            f"--host {host}: not an address or a name that resolves ({exc})"
        ) from None
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = "another program holds it"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = f"{host} is not an address of this machine"
        else:
            reason = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot bind {what} {port} on {host}: {reason} ([Errno {exc.errno}]); choose "
            f"another {what}, or 0 for any free port"
        ) from None
    return sock


def adopt_socket(fd: int) -> socket.socket:
    """The bound TCP socket inherited as file descriptor `fd` (made non-inheritable again);
    `ConfigError` if `fd` is not one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"--fd {fd}: not an open socket ({exc.strerror or exc})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ConfigError(f"--fd {fd}: not a TCP socket")
    sock.set_inheritable(False)
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port `sock` is bound to (the free one the kernel chose for port 0)."""
    return int(sock.getsockname()[1])


def bound_host(sock: socket.socket) -> str:
    return str(sock.getsockname()[0])
