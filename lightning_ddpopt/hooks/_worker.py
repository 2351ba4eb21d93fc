"""A thread beside the backward pass that runs a hook's jobs first in, first out.

PowerSGD's chains run on one, so that every rank issues their collectives in DDP's bucket order while the backward
pass goes on; int8's two later stages run on two, bucket after bucket, while the backward pass goes on; local SGD's
sync in flight is carried on on one as soon as it arrives (int8's second stage, an island's outer step and gather).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

__all__ = ["Worker"]

# Seconds teardown waits for the worker thread to finish the jobs it holds.
STOP_TIMEOUT_S = 60.0


class Worker:
    """One thread that runs submitted jobs first in, first out: a hook's buckets in DDP's order, on a CPU.

    ``failed`` holds the first error a job let through; jobs check it themselves and fail at once without issuing
    a collective (this rank would issue them out of step with the others).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._pid = os.getpid()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    def alive(self) -> bool:
        """False in a process forked after the thread started (the child has no such thread)."""
        return self._pid == os.getpid() and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every submitted job has run (nothing to wait for in a forked child)."""
        if not self.alive():
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def stop(self) -> bool:
        """Finish the jobs held and end the thread; False if it is still running after the timeout."""
        if self.alive():
            self._jobs.put(None)
            self._thread.join(timeout=STOP_TIMEOUT_S)
        return not self.alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as error:  # a job failing outside its own handling: fail all that follow
                self.failed = error
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
