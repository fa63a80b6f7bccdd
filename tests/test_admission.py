"""Admission and reordering on the controller's loop (no engine: the queue logic alone)."""

from __future__ import annotations

import asyncio

import pytest

from ragcache_core.pipeline.admission import Admission, Ticket


def test_capacity_is_respected_and_fcfs_order() -> None:
    async def main() -> list[int]:
        admission = Admission(capacity=1, queue="fcfs", window=0)
        order: list[int] = []

        async def request(i: int) -> None:
            ticket = Ticket(score=lambda: (0, 1))
            await admission.acquire(ticket)
            assert admission.in_prefill <= 1
            order.append(i)
            await asyncio.sleep(0)
            admission.release()

        await asyncio.gather(*(request(i) for i in range(5)))
        assert admission.in_prefill == 0
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_cache_aware_prefers_cached_requests() -> None:
    async def main() -> list[str]:
        admission = Admission(capacity=1, queue="cache_aware", window=10)
        order: list[str] = []
        blocker = Ticket(score=lambda: (0, 1))
        await admission.acquire(blocker)  # holds the only slot while the others queue

        async def request(name: str, cached: int, compute: int) -> None:
            await admission.acquire(Ticket(score=lambda: (cached, compute)))
            order.append(name)
            admission.release()

        tasks = [
            asyncio.ensure_future(request("cold", 0, 500)),
            asyncio.ensure_future(request("warm", 400, 100)),
            asyncio.ensure_future(request("hot", 490, 10)),
        ]
        await asyncio.sleep(0)
        admission.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["hot", "warm", "cold"]


@pytest.mark.parametrize("window", [0, 2, 5])
def test_hostile_stream_never_starves_beyond_window(window: int) -> None:
    """A cold request followed by an endless stream of hot ones is overtaken at most `window`
    times."""

    async def main() -> int:
        admission = Admission(capacity=1, queue="cache_aware", window=window)
        served: list[str] = []
        holder = Ticket(score=lambda: (0, 1))
        await admission.acquire(holder)

        async def request(name: str, cached: int) -> None:
            await admission.acquire(Ticket(score=lambda: (cached, 10)))
            served.append(name)
            admission.release()

        cold = asyncio.ensure_future(request("cold", 0))
        await asyncio.sleep(0)
        hot = []
        for i in range(20):  # hot requests keep arriving while the slot is busy
            hot.append(asyncio.ensure_future(request(f"hot{i}", 1000)))
        await asyncio.sleep(0)
        admission.release()
        await asyncio.gather(cold, *hot)
        return served.index("cold")

    assert asyncio.run(main()) <= window


def test_cancelled_waiter_gives_its_place_back() -> None:
    async def main() -> int:
        admission = Admission(capacity=1, queue="fcfs", window=0)
        holder = Ticket(score=lambda: (0, 1))
        await admission.acquire(holder)
        waiter = asyncio.ensure_future(admission.acquire(Ticket(score=lambda: (0, 1))))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        admission.release()
        return admission.in_prefill

    assert asyncio.run(main()) == 0
