"""JAX's coordination service in a small process of its own, started by process 0 of a job.

Hosted inside process 0 (JAX's way), the service dies with it, and JAX's client then ends every
other process by SIGABRT. Hosted here, process 0 is a process like any other: when it dies the
others raise from their next collective and exit by themselves.

The service process lives as long as the job needs it, never longer. It is started in a session
of its own (torchrun's stop, sent to a worker's process group, and a Ctrl-C to the terminal's
foreground group do not reach it). Every process of the job keeps a *watch* connection to it (the
OS closes it when the process ends, however it ends). At exit the processes wait there for each
other (`wait_to_leave`): a process that ended is not waited for, at once. Once no process is
connected, the service process shuts the service down and exits; if some process never connected
(it died while joining), it waits ``linger`` seconds for it first.

Run as a script (``python -P service_process.py ARGUMENTS_JSON``) it imports only the standard library
and jaxlib's extension (~0.2 s; jax would cost ~1 s more) and prints one line: ``ready PORT TOKEN``
(the watch port, and the token a process sends first) or ``error TEXT``.

Example::

    service = ServiceProcess.start("[::]:1234", 2, {"heartbeat_timeout": 30, "recoverable": True}, linger=70)
    watcher = connect_watcher("10.0.0.1", service.watch_address(), process_id=0)
    ...
    wait_to_leave(watcher, 600)   # at exit: returns once every live process is there
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import socket
import subprocess
import sys
import time

# the watch connection of a host that vanished without closing it (no FIN) counts as closed after ~60 s
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


class ServiceProcess:
    """Process 0's handle on the service process it started."""

    def __init__(self, process: subprocess.Popen, port: int, token: str):
        self.process, self.port, self.token = process, port, token

    @classmethod
    def start(cls, bind_address: str, num_processes: int, options: dict, linger: float) -> ServiceProcess:
        """Start the service on ``bind_address`` (JAX's ``coordinator_bind_address``, e.g. ``[::]:1234``)
        with jaxlib's service ``options``; return once it listens. Raises RuntimeError with the
        service process's error when it cannot start (a port in use)."""
        arguments = {"bind_address": bind_address, "num_processes": num_processes, "options": options}
        arguments["linger"] = linger
        process = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), json.dumps(arguments)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,  # out of reach of signals sent to process 0's group
        )
        assert process.stdout is not None
        line = process.stdout.readline().decode(errors="replace").strip()
        process.stdout.close()
        kind, _, rest = line.partition(" ")
        if kind != "ready":
            process.kill()
            process.wait()
            said = rest if kind == "error" else f"it ended with exit code {process.returncode} without a word"
            raise RuntimeError(
                f"initialize_distributed: process 0 could not start JAX's coordination service on {bind_address}: "
                f"{said}. Choose another port (SHARDTENSOR_COORDINATOR_PORT, or the coordinator address's)."
            )
        port, token = rest.split()
        return cls(process, int(port), token)

    def watch_address(self) -> str:
        """``'PORT TOKEN'``: where and how the processes connect their watch connections."""
        return f"{self.port} {self.token}"

    def stop(self) -> None:
        """End the service process now (after a failed join: the job never formed)."""
        self.process.kill()
        self.process.wait()


def connect_watcher(host: str, watch_address: str, process_id: int) -> socket.socket:
    """Connect process ``process_id`` to the service process at ``host`` (the coordinator's host);
    keep the socket open as long as the process lives (the OS closes it at the end).

    Example::

        watcher = connect_watcher("10.0.0.1", "40123 9f...", process_id=1)
    """
    port, token = watch_address.split()
    watcher = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    watcher.sendall(f"{token} {process_id}\n".encode())
    return watcher


def wait_to_leave(watcher: socket.socket, seconds: float) -> bool:
    """At exit: say so to the service process, and wait until every live process of the job said so
    too (a process that ended is not waited for). False when ``seconds`` passed first, or the
    service process is gone.

    Example::

        wait_to_leave(watcher, 600)   # True
    """
    deadline = time.monotonic() + seconds
    heard = b""
    try:
        watcher.sendall(b"leaving\n")
        while b"go\n" not in heard:
            watcher.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = watcher.recv(64)
            if not chunk:
                return False
            heard += chunk
    except OSError:  # timed out (socket.timeout is an OSError), or the service process is gone
        return False
    return True


def _watch_socket(bind_address: str) -> socket.socket:
    """A listening socket on the service's interfaces (all of them for ``[::]`` or ``0.0.0.0``)."""
    host = bind_address.rpartition(":")[0].strip("[]")
    if host in ("", "::", "0.0.0.0"):
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", 0))
    return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def _keep_alive(connection: socket.socket) -> None:
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Connection:
    """A connection to the watch port: it says ``TOKEN PROCESS_ID``, later ``leaving``."""

    def __init__(self, sock: socket.socket):
        self.socket, self.heard, self.process_id, self.leaving = sock, b"", None, False
        self.lines_read = 0

    def lines(self, data: bytes) -> list[str]:
        self.heard += data
        *complete, self.heard = self.heard.split(b"\n")
        self.lines_read += len(complete)
        return [line.decode(errors="replace") for line in complete]


def _serve(num_processes: int, linger: float, watch: socket.socket, token: str) -> None:
    """Until the job is over: keep the processes' watch connections, and let the processes at exit
    go once every live one is there."""
    selector = selectors.DefaultSelector()
    selector.register(watch, selectors.EVENT_READ)
    watchers: list[_Connection] = []  # open, said who they are
    came: set[int] = set()
    quiet_since = time.monotonic()  # when the last watch connection closed (or the start)

    def release() -> None:
        # every process connected before any could leave (they connect before the barrier that
        # ends joining), but their first words may not have been read yet
        if len(came) == num_processes and watchers and all(w.leaving for w in watchers):
            for w in watchers:
                with contextlib.suppress(OSError):
                    w.socket.sendall(b"go\n")
                w.leaving = False

    while watchers or (len(came) < num_processes and time.monotonic() < quiet_since + linger):
        for key, _ in selector.select(None if watchers else 1.0):
            if key.fileobj is watch:
                sock, _ = watch.accept()
                _keep_alive(sock)
                selector.register(sock, selectors.EVENT_READ, _Connection(sock))
                continue
            connection = key.data
            try:
                data = connection.socket.recv(1024)
            except OSError:
                data = b""
            if not data:  # the process ended (or a stranger left)
                selector.unregister(connection.socket)
                connection.socket.close()
                if connection in watchers:
                    watchers.remove(connection)
                    quiet_since = time.monotonic()
                    release()
                continue
            for line in connection.lines(data):
                said = line.split()
                if connection.process_id is None and len(said) == 2 and said[0] == token and said[1].isdigit():
                    connection.process_id = int(said[1])
                    watchers.append(connection)
                    came.add(connection.process_id)
                    release()
                elif connection.process_id is not None and line == "leaving":
                    connection.leaving = True
                    release()
                elif connection.process_id is None:  # a stranger on the port
                    break
            if connection.process_id is None and (connection.lines_read or len(connection.heard) > 256):
                selector.unregister(connection.socket)  # a stranger: it said something else first
                connection.socket.close()


def main(argv: list[str]) -> int:
    """The service process: start the service, say ``ready PORT TOKEN``, serve until the job is over."""
    arguments = json.loads(argv[1])
    try:
        watch = _watch_socket(arguments["bind_address"])
        from jaxlib import _jax  # only the extension: jax itself would cost ~1 s more

        service = _jax.get_distributed_runtime_service(
            arguments["bind_address"], arguments["num_processes"], **arguments["options"]
        )
    except Exception as e:  # noqa: BLE001 — reported to process 0, which raises it
        print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        return 1
    token = secrets.token_hex(16)
    print(f"ready {watch.getsockname()[1]} {token}", flush=True)
    sys.stdout.close()
    try:
        _serve(arguments["num_processes"], arguments["linger"], watch, token)
    finally:
        service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
