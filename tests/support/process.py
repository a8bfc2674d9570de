"""A child process of a test: its output goes to a log file, it can be waited for until ready, and it
is always stopped (SIGTERM, then SIGKILL after a grace period; the whole process group when it was
started in a session of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from support.waiting import wait_until


class ProcessExited(RuntimeError):
    """The process ended while a test waited for it to become ready."""


class ManagedProcess:
    #: The processes started and not stopped yet: a failing test's report shows the tracebacks in
    #: their logs (see ``tests/conftest.py``).
    live: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        new_session: bool = False,
        grace: float = 10.0,
    ) -> None:
        self.args = [str(a) for a in args]
        self.log = log
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.new_session = new_session
        self.grace = grace
        self.popen: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._out = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.args,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=self.new_session,
        )
        ManagedProcess.live.add(self)
        return self

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(
        self, ready: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05
    ) -> ManagedProcess:
        """Poll ``ready()`` (an OSError means "not yet") until it is truthy. A process that exits, or
        is not ready by the deadline, is stopped and the failure carries the tail of its log."""

        def probe() -> object:
            if not self.running:
                code = None if self.popen is None else self.popen.returncode
                raise ProcessExited(f"{what}: {self.args[:3]} exited ({code}):\n{self.tail()}")
            return ready()

        try:
            wait_until(probe, what, timeout, interval, ignore=(OSError,), dump=self.tail)
        except BaseException:
            self.stop()  # never leave a process behind that no fixture will stop
            raise
        return self

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the process (a no-op when it has ended) and return its exit status."""
        p = self.popen
        if p is not None and p.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                p.wait(self.grace if grace is None else grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                p.wait()
        if self._out is not None:
            self._out.close()
            self._out = None
        ManagedProcess.live.discard(self)
        return None if p is None else p.returncode

    def kill(self) -> None:
        """SIGKILL, no grace (a crash, as far as the others can tell)."""
        if self.running:
            self._signal(signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait()
        self.stop()

    def _signal(self, sig: signal.Signals) -> None:
        assert self.popen is not None
        if self.new_session:
            os.killpg(self.popen.pid, sig)
        else:
            self.popen.send_signal(sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def tracebacks(self, limit: int = 3, lines: int = 30) -> str:
        """The last ``limit`` Python tracebacks in the log, with the line before each (the message
        that logged it) and up to ``lines`` lines of each."""
        out = self.output().splitlines()
        starts = [i for i, line in enumerate(out) if line.startswith("Traceback (most recent call last)")]
        blocks = []
        for i in starts[-limit:]:
            block = out[max(i - 1, 0) : i + lines]
            end = next((j for j, line in enumerate(block[2:], 2) if line and not line[0].isspace()), None)
            blocks.append("\n".join(block[: end + 1] if end is not None else block))
        return "\n...\n".join(blocks)
