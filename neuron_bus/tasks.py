"""Background tasks that nobody awaits, each kept referenced until it is done.

asyncio holds only weak references to running tasks: a task started and not stored can be
garbage-collected mid-flight. `Background` keeps them (and cancels them on shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


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
