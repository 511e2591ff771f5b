"""Spawn one worker process per rank on this machine, talk to each over a pipe, and stop them all on a failure."""
from __future__ import annotations

import multiprocessing.connection as mpc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

GRACE_S = 1.0  # after the first failure, how long to gather the other ranks' reports
STOP_S = 5.0  # how long a worker gets to exit before it is killed
PARENT_POLL_S = 1.0  # how often a worker checks that the front end still lives
# A fresh interpreter per rank (not multiprocessing's spawn, which re-runs the user's __main__ module).
_CHILD = "from latentserve.distributed.launch import child_main; child_main()"


class WorkerFailure(RuntimeError):
    """One or more ranks raised or died; the message names each, the first raised error is the cause."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent: int) -> None:
    """End this worker once the front end is gone, even if a collective blocks its main thread."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def child_main() -> None:
    """Entry point of a worker process: its socket's fd is argv[1]; first sys.path, then the call arrive."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = mpc.Connection(int(sys.argv[1]))
    sys.path[:] = pickle.loads(conn.recv_bytes())
    target, args = conn.recv()
    target(*args, conn)


def exit_with_error(conn: mpc.Connection, error: BaseException) -> None:
    """Report `error` (being handled) to the front end and end this worker at once, skipping destructors that
    could block on dead peers."""
    text = traceback.format_exc()
    try:
        conn.send(("error", _pickled(error), text))
    except (OSError, ValueError):  # the front end is gone too
        pass
    os._exit(1)


def _pickled(error: BaseException) -> bytes | None:
    """`error` pickled if it comes back out of the pickle too; None sends its text alone."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)  # a constructor that wants other arguments than .args fails only here
        return data
    except Exception:  # noqa: BLE001 - any error that cannot cross still reports its text
        return None


class Workers:
    """`world_size` processes running `target(rank, world_size, init_method, *args, conn)`.

    A worker answers each message with ("ok", result) or ("error", exception, traceback text).
    """

    def __init__(self, target: Callable[..., None], world_size: int, args: tuple[Any, ...]) -> None:
        if target.__module__ == "__main__":
            raise ValueError(f"{target.__qualname__} must be importable by the workers: define it in a module")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.conns: list[mpc.Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.error: WorkerFailure | None = None
        for rank in range(world_size):
            parent, child = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno())], pass_fds=[child.fileno()])
            child.close()
            conn = mpc.Connection(parent.detach())
            self.conns.append(conn)
            self.procs.append(proc)
            conn.send_bytes(pickle.dumps(sys.path))
            conn.send((target, (rank, world_size, init_method, *args)))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, messages: list[Any]) -> None:
        """messages[r] to rank r."""
        self._check_alive()
        for rank, (conn, message) in enumerate(zip(self.conns, messages)):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError):
                self._fail({rank: self._death(rank)})

    def receive(self) -> list[Any]:
        """One answer from every rank; a rank that raises or dies stops all of them and raises WorkerFailure."""
        self._check_alive()
        results: dict[int, Any] = {}
        while len(results) < len(self.conns):
            waiting = [r for r in range(len(self.conns)) if r not in results]
            # A dead worker's socket reads as closed, so waiting on the sockets also watches the processes.
            ready = set(mpc.wait([self.conns[r] for r in waiting]))
            failures: dict[int, Any] = {}
            for r in waiting:
                answer = self._poll(r) if self.conns[r] in ready else None
                if answer is None:
                    continue
                if answer[0] == "ok":
                    results[r] = answer[1]
                else:
                    failures[r] = answer[1]
            if failures:
                self._fail(self._gather_more(failures, results))
        return [results[r] for r in range(len(self.conns))]

    def _poll(self, rank: int) -> tuple[str, Any] | None:
        conn = self.conns[rank]
        try:
            if conn.poll():
                kind, *payload = conn.recv()
                if kind == "ok":
                    return ("ok", payload[0])
                error, text = payload
                return ("error", _ReportedError(rank, _unpickled(error), text))
        except (EOFError, ConnectionError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an answer that cannot be unpickled here: the rank is of no more use
            return ("error", f"rank {rank} sent an answer the front end cannot read: {type(e).__name__}: {e}")
        if self._wait(self.procs[rank], 0.5):
            return ("error", self._death(rank))
        return None

    @staticmethod
    def _wait(proc: subprocess.Popen, timeout: float) -> bool:
        """Whether `proc` exited within `timeout` seconds."""
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _death(self, rank: int) -> str:
        self._wait(self.procs[rank], 1.0)
        code = self.procs[rank].returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"rank {rank} died: its process {how}"

    def _gather_more(self, failures: dict, results: dict) -> dict:
        """The reports of other ranks that fail within GRACE_S of the first (a death makes its peers raise too)."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            for r in range(len(self.conns)):
                if r not in failures and r not in results:
                    answer = self._poll(r)
                    if answer is not None and answer[0] == "error":
                        failures[r] = answer[1]
            time.sleep(0.05)
        return failures

    def _fail(self, failures: dict[int, Any]) -> None:
        self.shutdown(graceful=False)
        lines = [str(f) for _, f in sorted(failures.items())]
        cause = next((f.error for f in failures.values() if isinstance(f, _ReportedError)), None)
        self.error = WorkerFailure("data-parallel engine stopped:\n  " + "\n  ".join(lines))
        raise self.error from cause

    def check_alive(self) -> None:
        """Stop every rank and raise WorkerFailure if a worker process has exited (what an idle front end checks)."""
        self._check_alive()
        dead = {r: self._death(r) for r, proc in enumerate(self.procs) if proc.poll() is not None}
        if dead:
            self._fail(dead)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise WorkerFailure(f"the data-parallel engine has already stopped ({self.error})")

    def shutdown(self, graceful: bool = True) -> None:
        """Ask each worker to stop (graceful), then terminate and kill whatever is left; join every process."""
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(("stop", None))
                except (BrokenPipeError, ConnectionError, OSError):
                    pass
            deadline = time.monotonic() + STOP_S
            for proc in self.procs:
                self._wait(proc, max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            if not self._wait(proc, STOP_S):
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.error is None:
            self.error = WorkerFailure("shut down")


def _unpickled(data: bytes | None) -> BaseException | None:
    """The worker's exception, or None when this process cannot rebuild it (its text still says what it was)."""
    try:
        return None if data is None else pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. its class is not importable here
        return None


class _ReportedError:
    """A worker's own report of the exception it raised."""

    def __init__(self, rank: int, error: BaseException | None, text: str) -> None:
        self.rank = rank
        self.error = error
        self.text = text

    def __str__(self) -> str:
        last = self.text.strip().splitlines()[-1] if self.text.strip() else repr(self.error)
        return f"rank {self.rank} raised {last}"
