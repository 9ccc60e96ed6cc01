"""Where the store channel runs its steps: one worker thread per calling thread, which can be left when stuck.

A TCPStore request to a paused or cut-off host blocks its thread until TCP gives up (about 15 minutes): a caller
that must give up sooner cannot make that request itself. So each thread that enters a scheduler has one daemon
worker that runs its steps, handed over through a queue (about 20 µs a step); a caller that gives up on a step
abandons its worker and the next step gets a new one.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Step", "StepWorker", "forget_worker_of_this_thread", "worker_of_this_thread"]

T = TypeVar("T")


class Step(Generic[T]):
    """One function handed to a :class:`StepWorker`; ``done`` is set once it returned or raised.

    Examples:
        >>> from ignite_ext.distributed._steps import worker_of_this_thread
        >>> step = worker_of_this_thread().submit(lambda: 6 * 7)
        >>> step.done.wait(5), step.result()
        (True, 42)

    .. versionadded:: 0.2.0
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self.fn()
        except BaseException as exc:  # handed to the caller as is
            self._error = exc
        self.done.set()

    def result(self) -> T:
        """What the function returned, or its exception raised again (only once ``done`` is set)."""
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class StepWorker:
    """A daemon thread running the steps submitted to it, in order.

    .. versionadded:: 0.2.0
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Step[object] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ignite_ext-store-step", daemon=True).start()

    def _serve(self) -> None:
        while (step := self._queue.get()) is not None:
            step.run()

    def submit(self, fn: Callable[[], T]) -> Step[T]:
        step = Step(fn)
        self._queue.put(step)  # type: ignore[arg-type]
        return step

    def stop(self) -> None:
        """Let the thread end once its current step, if stuck, ever returns."""
        self._queue.put(None)


_THREAD = threading.local()


def worker_of_this_thread() -> StepWorker:
    """The worker that runs this thread's scheduler steps.

    .. versionadded:: 0.2.0
    """
    worker: StepWorker | None = getattr(_THREAD, "worker", None)
    if worker is None:
        worker = _THREAD.worker = StepWorker()
    return worker


def forget_worker_of_this_thread() -> None:
    """Leave this thread's worker to its stuck step; the next step gets a new one.

    .. versionadded:: 0.2.0
    """
    worker: StepWorker | None = getattr(_THREAD, "worker", None)
    _THREAD.worker = None
    if worker is not None:
        worker.stop()
