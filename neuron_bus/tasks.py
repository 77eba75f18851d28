"""Background tasks that nobody awaits, each kept referenced until it is done.

asyncio holds only weak references to running tasks: a task started and not stored can be
garbage-collected mid-flight. `Background` keeps them (and cancels them on shutdown). `InOrder`
runs them one after another per key (a session's outputs, a session's control requests) and
concurrently across keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable


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
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
