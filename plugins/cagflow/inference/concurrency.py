"""Asyncio glue between an event loop (Triton's stub runs ``execute`` on one) and the blocking answer
service: model work runs in a thread pool and reports back to the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import Executor
from typing import AsyncIterator, Callable, Iterator, Sequence

from .answer_cache import Claim
from .service import AnswerRequest, CagService, ServedAnswer


async def in_thread(pool: Executor, function: Callable, *args):
    return await asyncio.get_running_loop().run_in_executor(pool, function, *args)


async def answer_requests(service: CagService, pool: Executor,
                          requests: Sequence[AnswerRequest]) -> list[ServedAnswer | Exception]:
    """Answer one Triton batch, in order: repeats from the answer cache, questions already in flight by
    waiting for them, the rest computed in ``pool`` (one batched pass per snapshot and budget)."""
    claims: list[Claim | Exception] = []
    for request in requests:
        try:
            claims.append(service.claim(request))
        except Exception as exc:  # no active release...
            claims.append(exc)
    leading = [(request, claim) for request, claim in zip(requests, claims) if isinstance(claim, Claim) and claim.leads]
    await asyncio.gather(*(in_thread(pool, service.compute, group) for group in service.groups(leading)))
    results: list[ServedAnswer | Exception] = []
    for request, claim in zip(requests, claims):
        if isinstance(claim, Exception):
            results.append(claim)
            continue
        try:
            served = await asyncio.wrap_future(claim.future)
        except Exception as exc:
            results.append(exc)
            continue
        results.append(dataclasses.replace(served, request_id=request.request_id, source=claim.source))
    return results


async def iterate_in_thread(pool: Executor, make_iterator: Callable[[], Iterator]) -> AsyncIterator:
    """Run a blocking iterator in ``pool`` and yield its items on the event loop. Leaving the loop early
    (a cancelled stream) stops the iterator at its next item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    finished = object()

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                    if stop.is_set():
                        break
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except Exception as exc:
            loop.call_soon_threadsafe(queue.put_nowait, (None, exc))
            return
        loop.call_soon_threadsafe(queue.put_nowait, (finished, None))

    producer = loop.run_in_executor(pool, produce)
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is finished:
                return
            yield item
    finally:
        stop.set()
        await producer
