"""A worker run from inside a running event loop (`TaskQueue.run_worker_async`), the loop never blocked."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol

from sa_taskqueue.core.event_loop_bridge import EventLoopBridge


class RunsAndStops(Protocol):
    """A worker: `run` blocks until it is done; `stop` asks it to finish gracefully."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


async def run_attached(
    worker: RunsAndStops,
    loop: asyncio.AbstractEventLoop,
    bridge: EventLoopBridge,
    release: Callable[[], None],
    close_strategy: Callable[[], Awaitable[None]],
) -> None:
    """Run ``worker`` in a thread while the queue's calls run on ``loop``; a cancel stops it gracefully.

    ``release`` gives back, from a thread, the connections the queue keeps
    (opened on the engine's own loop) before calls move to ``loop``; with
    an async engine ``close_strategy`` closes what the strategy kept on
    ``loop`` once the worker is done.
    """
    attached: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if bridge.is_async:
        await asyncio.to_thread(release)
        attached = bridge.attached(loop)
    with attached:
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def run() -> None:
            try:
                worker.run()
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
                loop.call_soon_threadsafe(settle, error)
            else:
                loop.call_soon_threadsafe(settle, None)

        threading.Thread(target=run, name="sa_taskqueue-worker", daemon=True).start()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            worker.stop()
            # The drain runs its database calls on this loop: it must keep
            # running meanwhile, and this call must not return while the
            # worker still runs, even when cancelled again: its remaining
            # calls would go to a loop it is no longer attached to.
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(done)
            error = done.exception()
            if error is not None:
                raise error from None
            raise
        finally:
            if bridge.is_async:
                await close_strategy()


__all__ = ["RunsAndStops", "run_attached"]
