"""Test helpers: the real binaries of this workspace as processes on
loopback, polling waits (never fixed sleeps), and a TCP relay the tests can
cut to break every stream through it.

Binaries come from $DFLASH_BIN_DIR, else $CARGO_TARGET_DIR/debug, else
<repo>/target/debug (`make check-python` builds them first).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGE_ROOT = REPO_ROOT / "clients" / "python"
EXAMPLES = PACKAGE_ROOT / "examples"

T = TypeVar("T")


def binary_dir() -> pathlib.Path:
    if os.environ.get("DFLASH_BIN_DIR"):
        return pathlib.Path(os.environ["DFLASH_BIN_DIR"])
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or REPO_ROOT / "target")
    if not target.is_absolute():
        target = REPO_ROOT / target
    return target / "debug"


def binary(name: str) -> pathlib.Path:
    path = binary_dir() / name
    assert path.is_file(), f"{path} is missing: build the binaries first (cargo build --workspace --bins)"
    return path


def wait_until(
    condition: Callable[[], Optional[T]],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    children: Sequence["Process"] = (),
) -> T:
    """Polls `condition` until it returns something truthy; fails naming
    `what`. The hang guard: a child of `children` that exits with an error
    fails the wait at once, and the timeout names every child's state; both
    with the child's last log lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        for child in children:
            child.check_not_failed(what)
        if time.monotonic() > deadline:
            states = "".join(child.state_and_last_lines() for child in children)
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{states}")
        time.sleep(interval_s)


def consume_until_end(consumer, children: Sequence["Process"], timeout_s: float, what: str) -> Iterator:
    """The deliveries of a sync `consumer` until its end-of-stream, under the
    hang guard of `wait_until`: one of `children` (the processes whose data
    the test waits for) exiting with an error, or `timeout_s` passing, fails
    the test naming each child's last log lines, instead of waiting for an
    end-of-stream that only the broker's startup timeout would send."""
    deadline = time.monotonic() + timeout_s
    while True:
        delivery = consumer.receive(timeout_s=0.5)
        if delivery is not None:
            yield delivery
            continue
        if consumer.end_of_stream is not None:
            return
        for child in children:
            child.check_not_failed(what)
        if time.monotonic() > deadline:
            states = "".join(child.state_and_last_lines() for child in children)
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{states}")


# Every child this test session started, in order: the per-test hang guard
# of conftest.py names the ones a test started, with their last log lines.
STARTED: List["Process"] = []


class Process:
    """A child process whose stdout and stderr go to one log file."""

    def __init__(self, name: str, arguments: Sequence[str], log_dir: pathlib.Path, env: Optional[Dict[str, str]] = None):
        STARTED.append(self)
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        environment = dict(os.environ)
        environment.update(env or {})
        self.popen = subprocess.Popen(
            [str(argument) for argument in arguments],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def last_lines(self, count: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-count:])

    def state_and_last_lines(self, count: int = 40) -> str:
        """`name (running|exited N); its last log lines:` and those lines."""
        code = self.popen.poll()
        state = "running" if code is None else f"exited {code}"
        return f"\n--- {self.name} ({state}); its last {count} log lines:\n{self.last_lines(count)}"

    def check_not_failed(self, what: str) -> None:
        """Fails, naming the child's last log lines, when it exited with an
        error (the test waiting for `what` would otherwise wait on)."""
        code = self.popen.poll()
        if code is not None and code != 0:
            raise AssertionError(f"{self.name} exited {code} while the test waited for {what}{self.state_and_last_lines()}")

    def wait_for_log(self, pattern: str, timeout_s: float) -> re.Match:
        regex = re.compile(pattern)

        def found() -> Optional[re.Match]:
            match = regex.search(self.log())
            if match is None and self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) before logging {pattern!r}{self.state_and_last_lines()}")
            return match

        return wait_until(found, timeout_s, f"{self.name} to log {pattern!r}", children=[self])

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout_s:g}s{self.state_and_last_lines()}") from None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()


def wait_for_exits(children: Sequence[Process], timeout_s: float) -> None:
    """Waits until every child exited 0. The hang guard: one that exits with
    an error fails at once (its peers would wait on it), and the timeout
    names the ones still running; both with their last log lines."""
    wait_until(lambda: all(child.popen.poll() == 0 for child in children), timeout_s,
               "every child to exit 0: " + ", ".join(child.name for child in children), interval_s=0.1, children=children)


class Broker:
    """The real `broker` binary on an ephemeral loopback port."""

    def __init__(self, log_dir: pathlib.Path, expected_targets: int, *extra: str):
        self.process = Process(
            "broker",
            [binary("broker"), "--listen", "127.0.0.1:0", "--expected-targets", str(expected_targets), *extra],
            log_dir,
        )
        match = self.process.wait_for_log(r"broker listening.*?(127\.0\.0\.1:\d+)", 60)
        self.address = match.group(1)

    def stop(self) -> None:
        self.process.stop()


class Certificates:
    """A CA, the broker's certificate (localhost and 127.0.0.1) and a client
    certificate it signed, another CA that signed nothing here, and two
    tokens, made with the openssl command line (as scripts/check-deploy.sh
    does) in `folder`."""

    TOKEN = "t0ken-for-python-tests"
    WRONG_TOKEN = "not-the-token"

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
                      "-subj", "/CN=dflash python test CA", "-keyout", "ca.key", "-out", "ca.pem")
        self._openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
                      "-subj", "/CN=another CA", "-keyout", "other-ca.key", "-out", "other-ca.pem")
        for name, extensions in (
            ("broker", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
            ("client", "subjectAltName=DNS:drafter-0\nextendedKeyUsage=clientAuth\n"),
        ):
            self._openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                          "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
            (folder / f"{name}.ext").write_text(extensions)
            self._openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                          "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
        (folder / "token").write_text(self.TOKEN + "\n")
        (folder / "wrong-token").write_text(self.WRONG_TOKEN + "\n")

    def _openssl(self, *arguments: str) -> None:
        result = subprocess.run(["openssl", *arguments], cwd=self.folder, capture_output=True, text=True)
        assert result.returncode == 0, f"openssl {' '.join(arguments)} failed ({result.returncode}):\n{result.stderr}"

    def path(self, name: str) -> pathlib.Path:
        return self.folder / name


def python_process(name: str, arguments: Sequence[str], log_dir: pathlib.Path, env: Optional[Dict[str, str]] = None) -> Process:
    """A Python child running with this interpreter (and its sys.path)."""
    environment = {"PYTHONPATH": os.pathsep.join(path for path in sys.path if path), "PYTHONUNBUFFERED": "1"}
    environment.update(env or {})
    return Process(name, [sys.executable, *arguments], log_dir, environment)


def json_lines(text: str) -> List[dict]:
    records = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


class CuttableRelay:
    """A TCP relay from a loopback port to the broker. `cut()` closes every
    connection through it at once (each client sees its stream break, as
    when a broker restarts or a network blips), while the broker itself
    keeps its state; new connections work again right away."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._writers: List[asyncio.StreamWriter] = []
        self.cuts = 0
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        self.address = f"127.0.0.1:{self._port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self._port = listener.getsockname()[1]
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, sock=listener))
        ready.set()
        self._loop.run_forever()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        self._writers += [client_writer, upstream_writer]

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    data = await reader.read(1 << 16)
                    if not data:
                        break
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    def retarget(self, upstream: str) -> None:
        """New connections go to `upstream` (a broker restarted on another
        port); those open now stay where they are until `cut()`."""
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))

    def cut(self) -> None:
        async def cut_all() -> None:
            writers, self._writers = self._writers, []
            for writer in writers:
                transport = writer.transport
                if transport is not None:
                    transport.abort()

        asyncio.run_coroutine_threadsafe(cut_all(), self._loop).result(10)
        self.cuts += 1

    def close(self) -> None:
        async def shut_down() -> None:
            self._server.close()
            for writer in self._writers:
                if writer.transport is not None:
                    writer.transport.abort()
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut_down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
