"""Threads beside the backward pass that run a hook's jobs first in, first out, and the two-tier hooks' stages.

PowerSGD's chains run on one, so that every rank issues their collectives in DDP's bucket order while the backward
pass goes on; int8's two later stages run on two, bucket after bucket, while the backward pass goes on; local SGD's
sync in flight is carried on on one as soon as it arrives (int8's second stage, an island's outer step and gather);
a two-tier hook's three stages run on three (:class:`TierStages`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lightning_ddpopt.hooks.base import CommHookState

__all__ = ["TierStages", "TierSync", "Worker", "run_all"]

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


class TierSync(Protocol):
    """One bucket's two-tier sync in three stages, as :class:`TierStages` and :func:`run_all` run them."""

    buffer: torch.Tensor

    def reduce_inside(self) -> None:
        """Stage 1, on the intra-node group: the node's sum, of which this rank keeps its shard."""

    def reduce_between(self) -> None:
        """Stage 2, on the cross-node group: the shard's sum over the nodes."""

    def gather(self) -> None:
        """Stage 3, on the intra-node gather group: every reduced shard into the bucket."""

    def abandon(self) -> None:
        """A stage failed (this bucket's or an earlier one's): drop whatever the sync would have kept."""


class TierStages:
    """A two-tier hook's stages on a CPU: one thread each (inside, between, gather), bucket after bucket.

    Each stage issues its collectives on a group of its own (:class:`~lightning_ddpopt.topology.TierGroups`), in
    DDP's bucket order, so every rank issues each group's collectives in one order; while one bucket crosses nodes,
    the next is summed inside the node and the one before is gathered. ``failed`` holds the first failure: every
    later stage fails its bucket at once, without issuing a collective (this rank would be out of step).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._threads: list[Worker] = []
        self.failed: BaseException | None = None

    def check(self) -> None:
        """Raise if an earlier bucket failed: a hook calls it before it records or opens anything for a bucket."""
        if self.failed is not None:
            raise RuntimeError(f"the hierarchical sync stopped after an earlier bucket failed: {self.failed!r}")

    def run(self, state: CommHookState, sync: TierSync, index: int) -> torch.futures.Future[torch.Tensor]:
        """Hand ``sync`` to the first stage; its future completes after the last stage (or fails with a stage).

        Each stage's host seconds go to the ledger for bucket ``index``: inside the node (the first and the last
        stage) or between the nodes.

        Args:
            state: the hook's state (its ledger and host seconds).
            sync: the bucket's three stages.
            index: the bucket's index.
        """
        self.check()
        if not self._threads or not all(thread.alive() for thread in self._threads):
            self._threads = [Worker(f"{self.prefix}-{name}") for name in ("inside", "between", "gather")]
        threads, stages = self._threads, (sync.reduce_inside, sync.reduce_between, sync.gather)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def job(stage: int) -> None:
            if self.failed is not None:  # issuing this bucket's collectives would put this rank out of step
                error = RuntimeError(f"an earlier bucket's hierarchical sync failed: {self.failed!r}")
                sync.abandon()
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result
                return
            start = time.perf_counter()
            try:
                stages[stage]()
                state.record_tier_seconds(index, time.perf_counter() - start, intra_node=stage != 1)
            except Exception as error:  # DDP waits on the future: never leave it pending
                self.failed = error
                sync.abandon()
                future.set_exception(error)  # type: ignore[arg-type]
                return
            finally:
                state.add_seconds(time.perf_counter() - start)
            if stage + 1 < len(stages):
                threads[stage + 1].submit(lambda: job(stage + 1))
            else:
                future.set_result(sync.buffer)

        threads[0].submit(lambda: job(0))
        return future

    def drain(self) -> None:
        """Wait until every bucket handed in has been through every stage."""
        for thread in self._threads:  # each stage hands buckets to the next: drain them in order
            thread.drain()

    def close(self) -> bool:
        """Stop the threads, first to last, each after its jobs; False at the first still busy.

        The later stages are then kept: the busy one may still hand them a bucket.
        """
        for index, thread in enumerate(self._threads):
            if not thread.stop():
                self._threads = self._threads[index:]
                return False
        self._threads = []
        return True


def run_all(sync: TierSync) -> torch.futures.Future[torch.Tensor]:
    """Every stage here and now (CUDA: on a side stream, whose waits order that stream only)."""
    sync.reduce_inside()
    sync.reduce_between()
    sync.gather()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[sync.buffer.device])
    future.set_result(sync.buffer)
    return future
