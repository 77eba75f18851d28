"""Background tasks that nobody awaits, each kept referenced until it is done.

asyncio holds only weak references to running tasks: a task started and not stored can be
garbage-collected mid-flight. `Background` keeps them (and cancels them on shutdown). `InOrder`
runs them one after another per key (a session's outputs, a session's control requests) and
concurrently across keys. `cancel_and_wait` cancels tasks and waits until they have really ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable

CANCEL_REPEAT_S = 1.0  # a task still running this long after its cancellation is cancelled again


async def cancel_and_wait(*tasks: asyncio.Task | None, repeat_s: float = CANCEL_REPEAT_S) -> None:
    """Cancel the tasks and wait until each has ended (``None`` and finished tasks are skipped).

    One cancellation is not always enough. Python 3.11's ``asyncio.wait_for``, which nats-py's
    requests and JetStream publishes use, returns a result that arrives together with the
    cancellation and drops the cancellation (CPython gh-86296), and the task goes on: a loop of
    requests then never ends, and whoever awaits it waits forever. So a task still running
    ``repeat_s`` after its cancellation is cancelled again, until it ends. A task's own clean-up
    after a cancellation must take less than ``repeat_s``, or the next cancellation cuts it short.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    ended = [t for t in tasks if t is not None and t.done()]
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=repeat_s)
        ended.extend(done)
    for task in ended:  # retrieved, so that asyncio does not log them as never retrieved
        if not task.cancelled():
            task.exception()


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        await cancel_and_wait(*self._tasks)


class InOrder:
    """Background tasks per key, each started once the key's previous one has finished; so the
    latest task of a key stands for all of them."""

    def __init__(self, background: Background | None = None) -> None:
        self.background = background or Background()
        self._last: dict[Hashable, asyncio.Task] = {}  # key -> its latest task not finished yet

    def spawn(self, key: Hashable, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        before = self._last.get(key)

        async def after(before: asyncio.Task) -> object:
            try:
                await asyncio.wait([before])
            except BaseException:
                coro.close()  # cancelled before it started
                raise
            return await coro

        # nothing of the key in flight (a session's usual case): the coroutine is the task itself
        task = self.background.spawn(coro if before is None else after(before), name=name)
        self._last[key] = task
        task.add_done_callback(lambda t: self._last.pop(key) if self._last.get(key) is t else None)
        return task

    def latest(self, key: Hashable) -> asyncio.Task | None:
        return self._last.get(key)

    async def settled(self, key: Hashable, timeout: float | None = None) -> None:
        """Until the key's tasks have finished (or ``timeout``)."""
        task = self._last.get(key)
        if task is not None:
            await asyncio.wait([task], timeout=timeout)

    async def cancel_all(self) -> None:
        await self.background.cancel_all()
