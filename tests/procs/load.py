"""A load generator: busy processes, one more than the machine has cores, so that every core is
busy and the processes under test compete for CPU (as on a shared CI box)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import TracebackType

BUSY = "while True: pass"


class BusyCores:
    """``with BusyCores() as load: ...``: ``os.cpu_count() + 1`` busy processes meanwhile;
    :meth:`cpu_seconds` is the CPU time they got (the evidence that the load was real)."""

    def __init__(self, extra: int = 1) -> None:
        self.count = (os.cpu_count() or 1) + extra
        self.procs: list[subprocess.Popen[bytes]] = []
        self.cpu = 0.0

    def __enter__(self) -> BusyCores:
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.count)]
        return self

    def cpu_seconds(self) -> float:
        """CPU seconds the busy processes used so far (all of it, once they stopped)."""
        if not self.procs:
            return self.cpu
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for proc in self.procs:
            with open(f"/proc/{proc.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        return total

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cpu = self.cpu_seconds()
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []
