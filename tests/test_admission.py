"""Admission and reordering on the RAGCache's loop (no engine: the queue logic alone)."""

from __future__ import annotations

import asyncio

import pytest

from ragcache_core.runtime.admission import Admission, Ticket


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


def test_token_budget_admits_what_fits_and_a_large_request_alone() -> None:
    async def main() -> list[tuple[str, int, int]]:
        admission = Admission(capacity=8, queue="fcfs", window=0, token_budget=1000)
        seen: list[tuple[str, int, int]] = []
        big = await admission.acquire(Ticket(score=lambda: (0, 5000)))  # alone: admitted
        seen.append(("big", admission.in_prefill, admission.prefill_tokens))
        assert admission.try_acquire(10) is None  # nothing else fits beside it
        waiters = [
            asyncio.ensure_future(admission.acquire(Ticket(score=lambda: (0, 400))))
            for _ in range(3)
        ]
        await asyncio.sleep(0)
        assert admission.waiting == 3
        big.release()  # two of the three 400-token requests fit in 1,000
        await asyncio.sleep(0)
        seen.append(("after", admission.in_prefill, admission.prefill_tokens))
        slots = [w.result() for w in waiters if w.done()]
        for slot in slots:
            slot.release()
        await asyncio.gather(*waiters)
        for w in waiters:
            w.result().release()
        seen.append(("end", admission.in_prefill, admission.prefill_tokens))
        return seen

    assert asyncio.run(main()) == [("big", 1, 5000), ("after", 2, 800), ("end", 0, 0)]


def test_a_request_waiting_on_a_document_in_flight_is_deferred_then_queued() -> None:
    """A request whose next document another request in prefill is computing waits for it
    (even with room in prefill), and is admitted once that request's first token makes the
    document readable."""

    async def main() -> list[str]:
        admission = Admission(capacity=4, queue="cache_aware", window=4)
        in_flight = {"doc": True}
        events: list[str] = []
        writer = await admission.acquire(Ticket(score=lambda: (0, 100)))
        reader = asyncio.ensure_future(
            admission.acquire(
                Ticket(
                    score=lambda: (100 if not in_flight["doc"] else 0, 10),
                    blocked=lambda: in_flight["doc"],
                )
            )
        )
        other = asyncio.ensure_future(admission.acquire(Ticket(score=lambda: (0, 50))))
        await asyncio.sleep(0)
        events.append(f"deferred={admission.deferrals} waiting={admission.waiting}")
        assert not reader.done() and other.done()  # the unblocked one is not held back
        other.result().release()
        await asyncio.sleep(0)
        assert not reader.done()  # still blocked: the writer has not confirmed yet
        in_flight["doc"] = False  # the writer's first token: its document is readable
        writer.release()
        await asyncio.sleep(0)
        events.append(f"reader admitted={reader.done()} in_prefill={admission.in_prefill}")
        reader.result().release()
        events.append(f"end in_prefill={admission.in_prefill} waiting={admission.waiting}")
        return events

    assert asyncio.run(main()) == [
        "deferred=1 waiting=1",
        "reader admitted=True in_prefill=1",
        "end in_prefill=0 waiting=0",
    ]


def test_a_deferred_request_never_waits_on_an_empty_prefill() -> None:
    """Nothing in prefill means nobody will unblock it: a blocked request is admitted at
    once, and one deferred earlier is released when prefill empties."""

    async def main() -> tuple[bool, bool, int]:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        alone = await admission.acquire(Ticket(score=lambda: (0, 1), blocked=lambda: True))
        deferred = asyncio.ensure_future(
            admission.acquire(Ticket(score=lambda: (0, 1), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        was_deferred = not deferred.done()
        alone.release()  # prefill empties: the deferred one must go
        await asyncio.sleep(0)
        admitted = deferred.done()
        deferred.result().release()
        return was_deferred, admitted, admission.in_prefill

    assert asyncio.run(main()) == (True, True, 0)


def test_a_cancelled_deferred_request_leaves_nothing_behind() -> None:
    async def main() -> tuple[int, int]:
        admission = Admission(capacity=2, queue="fcfs", window=0)
        holder = await admission.acquire(Ticket(score=lambda: (0, 1)))
        waiter = asyncio.ensure_future(
            admission.acquire(Ticket(score=lambda: (0, 1), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        holder.release()
        return admission.in_prefill, admission.waiting

    assert asyncio.run(main()) == (0, 0)


def test_a_writer_that_fails_unblocks_its_deferred_readers() -> None:
    """The writer of an in-flight document aborts (its node leaves the tree) and releases:
    the deferred reader is admitted (it will compute the document itself)."""

    async def main() -> tuple[bool, bool, int]:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        node = {"in_flight": True}
        writer = await admission.acquire(Ticket(score=lambda: (0, 100)))
        other = await admission.acquire(Ticket(score=lambda: (0, 100)))  # keeps prefill busy
        reader = asyncio.ensure_future(
            admission.acquire(Ticket(score=lambda: (0, 100), blocked=lambda: node["in_flight"]))
        )
        await asyncio.sleep(0)
        deferred = not reader.done()
        node["in_flight"] = False  # the writer's abort removed the node ...
        writer.release()  # ... before it released its room (runtime/generation.py's order)
        await asyncio.sleep(0)
        admitted = reader.done()
        reader.result().release()
        other.release()
        return deferred, admitted, admission.in_prefill

    assert asyncio.run(main()) == (True, True, 0)


def test_a_release_before_the_confirm_would_leave_the_reader_waiting() -> None:
    """Why runtime/generation.py confirms before it releases: a release seen while the document is
    still in flight re-checks the deferred reader too early, and with another request in
    prefill nothing wakes it when the confirm comes later."""

    async def main() -> bool:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        node = {"in_flight": True}
        writer = await admission.acquire(Ticket(score=lambda: (0, 100)))
        other = await admission.acquire(Ticket(score=lambda: (0, 100)))
        reader = asyncio.ensure_future(
            admission.acquire(Ticket(score=lambda: (0, 100), blocked=lambda: node["in_flight"]))
        )
        await asyncio.sleep(0)
        writer.release()  # the wrong order: released first ...
        node["in_flight"] = False  # ... confirmed after
        await asyncio.sleep(0)
        stuck = not reader.done()
        other.release()  # the next release (or an empty prefill) finally admits it
        await asyncio.sleep(0)
        reader.result().release()
        return stuck

    assert asyncio.run(main()) is True


def test_speculation_takes_no_room_while_a_request_is_deferred() -> None:
    async def main() -> tuple[bool, bool]:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        holder = await admission.acquire(Ticket(score=lambda: (0, 10)))
        free_before = admission.try_acquire(10)
        assert free_before is not None
        free_before.release()
        reader = asyncio.ensure_future(
            admission.acquire(Ticket(score=lambda: (0, 10), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        refused = admission.try_acquire(10) is None
        holder.release()  # prefill empties: the deferred one is admitted
        await asyncio.sleep(0)
        admitted = reader.done()
        reader.result().release()
        return refused, admitted

    assert asyncio.run(main()) == (True, True)
