"""InOrder (neuron_bus/tasks.py): tasks of one key run one after another in the order spawned,
tasks of different keys at once; one cancelled before its turn never starts its coroutine."""

from __future__ import annotations

import asyncio

from neuron_bus.tasks import CANCEL_REPEAT_S, Background, InOrder, cancel_and_wait


def test_one_key_runs_in_order_and_keys_run_concurrently():
    async def scenario():
        order = InOrder()
        log: list[str] = []
        gates = {k: asyncio.Event() for k in ("a1", "b1")}

        async def step(name: str, gate: asyncio.Event | None = None) -> None:
            log.append(f"{name} start")
            if gate is not None:
                await gate.wait()
            log.append(f"{name} end")

        order.spawn("a", step("a1", gates["a1"]))
        last_a = order.spawn("a", step("a2"))
        order.spawn("b", step("b1", gates["b1"]))
        await asyncio.sleep(0.01)
        # b1 started while a1 holds key a; a2 waits for a1
        assert log == ["a1 start", "b1 start"], log
        assert order.latest("a") is last_a
        gates["b1"].set()
        await asyncio.sleep(0.01)
        assert "a2 start" not in log
        gates["a1"].set()
        await order.settled("a", timeout=1.0)
        assert log.index("a1 end") < log.index("a2 start") < log.index("a2 end"), log
        assert order.latest("a") is None and order.latest("b") is None

    asyncio.run(scenario())


def test_a_task_cancelled_before_its_turn_never_starts():
    async def scenario():
        order = InOrder()
        started: list[str] = []
        gate = asyncio.Event()

        async def step(name: str) -> None:
            started.append(name)
            await gate.wait()

        order.spawn("k", step("first"))
        second = order.spawn("k", step("second"))
        await asyncio.sleep(0.01)
        second.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await order.settled("k", timeout=1.0)
        await order.cancel_all()
        assert started == ["first"]
        assert second.cancelled()

    asyncio.run(scenario())


def test_stop_ends_a_task_that_dropped_its_cancellation():
    """On Python 3.11 a request loop drops a cancellation that arrives with an answer (wait_for's
    gh-86296): one cancel and a wait hangs; `cancel_and_wait` cancels again until the task has ended."""

    async def scenario():
        loop = asyncio.get_running_loop()
        answers: list[asyncio.Future] = []
        rounds = 0

        async def request_loop() -> None:  # as a loop of nats-py requests
            nonlocal rounds
            while True:
                answer = loop.create_future()
                answers.append(answer)
                await asyncio.wait_for(answer, 30)
                rounds += 1

        async def deaf_once() -> None:  # a task that dropped one cancellation, on any Python
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(30)

        async def failing() -> None:
            raise ValueError("ended badly")

        background = Background()
        looping = background.spawn(request_loop())
        deaf = background.spawn(deaf_once())
        failed = background.spawn(failing())
        await asyncio.sleep(0.01)
        answers[-1].set_result("answer")  # the answer arrives together with the cancellation below
        await asyncio.wait_for(background.cancel_all(), 10 * CANCEL_REPEAT_S)
        assert looping.done() and deaf.cancelled() and failed.done()
        assert len(background) == 0
        await cancel_and_wait(None, looping, deaf)  # finished tasks and None: nothing to do

    asyncio.run(scenario())
