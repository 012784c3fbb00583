"""The one thread that drives the engine: requests run one at a time, in arrival order.

Batch 1 is the point of kiec, so the engine is never shared: the event loop submits a
`Job`, this thread runs the engine's generator and hands each `Token` back to the
loop with `call_soon_threadsafe` (the loop never waits on the engine). A bounded
number of jobs may wait; past that `submit` raises `QueueFull`. A job cancelled by
its client (it disconnected) stops at its next token, or between chunks of its prompt where the
backend takes it in several, or is skipped if still waiting,
so the engine goes straight to the next one; a waiting job stops counting against the
bound as soon as its client leaves, not when the engine reaches it. Keeping every engine
call on one thread also suits a GPU backend, whose device context belongs to a thread.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from ..errors import Cancelled, is_request_error

log = logging.getLogger("kiec.serve")
DONE = object()          # the end-of-job marker in a job's event queue


class QueueFull(Exception):
    pass


class Job:
    def __init__(self, prompt: list, params, loop: asyncio.AbstractEventLoop, on_cancel=lambda job: None):
        self.prompt, self.params, self.loop, self._on_cancel = prompt, params, loop, on_cancel
        self.events: asyncio.Queue = asyncio.Queue()    # Token, an exception, then DONE; read on the loop
        self.cancelled = threading.Event()
        self.stats = None                                 # the engine's Stats, once it ran
        self.submitted = time.perf_counter()
        self.started = None
        self.queued = True           # counted in the worker's `waiting` (under its lock)
        self.left_in_prompt = False  # cancelled while its prompt went in (no token came)

    def cancel(self) -> None:
        self.cancelled.set()
        self._on_cancel(self)

    @property
    def queued_s(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted

    def _emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:          # the loop has closed (server shutting down): nobody is listening
            self.cancel()

    async def tokens(self):
        """The job's tokens as they come; raises what the engine raised."""
        while True:
            item = await self.events.get()
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class EngineWorker:
    def __init__(self, engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.waiting = 0
        self.running = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._current: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kiec-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list, params) -> Job:
        """Queues a job (call on the event loop); QueueFull when max_queue jobs already wait."""
        with self._lock:
            if self.waiting >= self.max_queue and (self.running or self.waiting):
                self.counts["rejected"] += 1
                raise QueueFull()
            self.waiting += 1
        job = Job(prompt, params, asyncio.get_running_loop(), self._leave_queue)
        self._jobs.put(job)
        return job

    def _leave_queue(self, job: Job) -> None:
        """The job stops counting as waiting, once: when the engine takes it or when its client
        leaves first (a cancelled job stays in the queue until the engine skips it)."""
        with self._lock:
            if job.queued:
                job.queued = False
                self.waiting -= 1

    def status(self) -> dict:
        with self._lock:
            return {"running": self.running, "waiting": self.waiting, "max_queue": self.max_queue, **self.counts}

    def stop(self) -> None:
        """Cancels the running and waiting jobs and ends the thread (server shutdown)."""
        self._stopping = True
        if self._current is not None:
            self._current.cancel()
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._leave_queue(job)
            with self._lock:
                self.running = True
            self._current = job
            if self._stopping:
                job.cancel()
            outcome = self._generate(job)
            self._current = None
            with self._lock:
                self.running = False
                self.counts[outcome] += 1
            job._emit(DONE)

    def _generate(self, job: Job) -> str:
        job.started = time.perf_counter()
        if job.cancelled.is_set():
            return "cancelled"
        tokens = None
        try:                                  # an engine that fails even to start fails the job, not this thread
            tokens = self.engine.generate(job.prompt, job.params, job.cancelled.is_set)
            for token in tokens:
                job.stats = self.engine.last_stats     # this job's, from its first token on
                job._emit(token)
                if job.cancelled.is_set():    # the client left: the next token is never computed
                    return "cancelled"
            return "completed"
        except Cancelled:                     # the client left while its prompt went in
            job.left_in_prompt = True
            return "cancelled"
        except Exception as err:              # the job's client gets it; the worker goes on
            if not is_request_error(err):
                log.exception("engine failed on a request")
            job._emit(err)
            return "failed"
        finally:
            if tokens is not None:
                tokens.close()
