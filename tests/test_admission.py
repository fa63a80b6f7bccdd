"""Admission and reordering on the RAGCache's loop (no engine: the queue logic alone)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from ragcache_core.config import SamplingConfig
from ragcache_core.runtime.admission import Admission
from ragcache_core.runtime.attempt import Attempt, Request
from ragcache_core.runtime.prompt import BuiltPrompt


def request(
    score: Callable[[], tuple[int, int]], blocked: Callable[[], bool] = lambda: False
) -> Attempt:
    """A request's try as admission sees it: its request's score and whether it is blocked
    (no prompt)."""
    prompt = BuiltPrompt((), (), (), ())
    return Request(prompt, SamplingConfig(), score=score, blocked=blocked).attempt


async def admit(admission: Admission, attempt: Attempt) -> Attempt:
    """`attempt`, once admission let it in."""
    await admission.acquire(attempt)
    return attempt


def test_capacity_is_respected_and_fcfs_order() -> None:
    async def main() -> list[int]:
        admission = Admission(capacity=1, queue="fcfs", window=0)
        order: list[int] = []

        async def run(i: int) -> None:
            attempt = request(lambda: (0, 1))
            await admission.acquire(attempt)
            assert admission.in_prefill <= 1
            order.append(i)
            await asyncio.sleep(0)
            admission.release(attempt)

        await asyncio.gather(*(run(i) for i in range(5)))
        assert admission.in_prefill == 0
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_cache_aware_prefers_cached_requests() -> None:
    async def main() -> list[str]:
        admission = Admission(capacity=1, queue="cache_aware", window=10)
        order: list[str] = []
        blocker = request(lambda: (0, 1))
        await admission.acquire(blocker)  # holds the only slot while the others queue

        async def run(name: str, cached: int, compute: int) -> None:
            attempt = request(lambda: (cached, compute))
            await admission.acquire(attempt)
            order.append(name)
            admission.release(attempt)

        tasks = [
            asyncio.ensure_future(run("cold", 0, 500)),
            asyncio.ensure_future(run("warm", 400, 100)),
            asyncio.ensure_future(run("hot", 490, 10)),
        ]
        await asyncio.sleep(0)
        admission.release(blocker)
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
        holder = request(lambda: (0, 1))
        await admission.acquire(holder)

        async def run(name: str, cached: int) -> None:
            attempt = request(lambda: (cached, 10))
            await admission.acquire(attempt)
            served.append(name)
            admission.release(attempt)

        cold = asyncio.ensure_future(run("cold", 0))
        await asyncio.sleep(0)
        hot = []
        for i in range(20):  # hot requests keep arriving while the slot is busy
            hot.append(asyncio.ensure_future(run(f"hot{i}", 1000)))
        await asyncio.sleep(0)
        admission.release(holder)
        await asyncio.gather(cold, *hot)
        return served.index("cold")

    assert asyncio.run(main()) <= window


def test_cancelled_waiter_gives_its_place_back() -> None:
    async def main() -> int:
        admission = Admission(capacity=1, queue="fcfs", window=0)
        holder = request(lambda: (0, 1))
        await admission.acquire(holder)
        waiter = asyncio.ensure_future(admission.acquire(request(lambda: (0, 1))))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        admission.release(holder)
        return admission.in_prefill

    assert asyncio.run(main()) == 0


def test_token_budget_admits_what_fits_and_a_large_request_alone() -> None:
    async def main() -> list[tuple[str, int, int]]:
        admission = Admission(capacity=8, queue="fcfs", window=0, token_budget=1000)
        seen: list[tuple[str, int, int]] = []
        big = request(lambda: (0, 5000))
        await admission.acquire(big)  # alone: admitted
        seen.append(("big", admission.in_prefill, admission.prefill_tokens))
        assert not admission.try_acquire(request(lambda: (0, 10)))  # nothing fits beside it
        attempts = [request(lambda: (0, 400)) for _ in range(3)]
        waiters = [asyncio.ensure_future(admission.acquire(a)) for a in attempts]
        await asyncio.sleep(0)
        assert admission.waiting == 3
        admission.release(big)  # two of the three 400-token requests fit in 1,000
        await asyncio.sleep(0)
        seen.append(("after", admission.in_prefill, admission.prefill_tokens))
        admitted = [a for a, w in zip(attempts, waiters, strict=True) if w.done()]
        for attempt in admitted:
            admission.release(attempt)
        await asyncio.gather(*waiters)
        for attempt in attempts:
            admission.release(attempt)  # a second release of the first two changes nothing
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
        writer = await admit(admission, request(score=lambda: (0, 100)))
        reader = asyncio.ensure_future(
            admit(
                admission,
                request(
                    score=lambda: (100 if not in_flight["doc"] else 0, 10),
                    blocked=lambda: in_flight["doc"],
                ),
            )
        )
        other = asyncio.ensure_future(admit(admission, request(score=lambda: (0, 50))))
        await asyncio.sleep(0)
        events.append(f"deferred={admission.deferrals} waiting={admission.waiting}")
        assert not reader.done() and other.done()  # the unblocked one is not held back
        admission.release(other.result())
        await asyncio.sleep(0)
        assert not reader.done()  # still blocked: the writer has not confirmed yet
        in_flight["doc"] = False  # the writer's first token: its document is readable
        admission.release(writer)
        await asyncio.sleep(0)
        events.append(f"reader admitted={reader.done()} in_prefill={admission.in_prefill}")
        admission.release(reader.result())
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
        alone = await admit(admission, request(score=lambda: (0, 1), blocked=lambda: True))
        deferred = asyncio.ensure_future(
            admit(admission, request(score=lambda: (0, 1), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        was_deferred = not deferred.done()
        admission.release(alone)  # prefill empties: the deferred one must go
        await asyncio.sleep(0)
        admitted = deferred.done()
        admission.release(deferred.result())
        return was_deferred, admitted, admission.in_prefill

    assert asyncio.run(main()) == (True, True, 0)


def test_a_cancelled_deferred_request_leaves_nothing_behind() -> None:
    async def main() -> tuple[int, int]:
        admission = Admission(capacity=2, queue="fcfs", window=0)
        holder = await admit(admission, request(score=lambda: (0, 1)))
        waiter = asyncio.ensure_future(
            admit(admission, request(score=lambda: (0, 1), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        admission.release(holder)
        return admission.in_prefill, admission.waiting

    assert asyncio.run(main()) == (0, 0)


def test_a_writer_that_fails_unblocks_its_deferred_readers() -> None:
    """The writer of an in-flight document aborts (its node leaves the tree) and releases:
    the deferred reader is admitted (it will compute the document itself)."""

    async def main() -> tuple[bool, bool, int]:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        node = {"in_flight": True}
        writer = await admit(admission, request(score=lambda: (0, 100)))
        other = await admit(admission, request(score=lambda: (0, 100)))  # keeps prefill busy
        reader = asyncio.ensure_future(
            admit(admission, request(score=lambda: (0, 100), blocked=lambda: node["in_flight"]))
        )
        await asyncio.sleep(0)
        deferred = not reader.done()
        node["in_flight"] = False  # the writer's abort removed the node ...
        admission.release(writer)  # ... before it released its room (runtime/generation.py's order)
        await asyncio.sleep(0)
        admitted = reader.done()
        admission.release(reader.result())
        admission.release(other)
        return deferred, admitted, admission.in_prefill

    assert asyncio.run(main()) == (True, True, 0)


def test_a_release_before_the_confirm_would_leave_the_reader_waiting() -> None:
    """Why runtime/generation.py confirms before it releases: a release seen while the document is
    still in flight re-checks the deferred reader too early, and with another request in
    prefill nothing wakes it when the confirm comes later."""

    async def main() -> bool:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        node = {"in_flight": True}
        writer = await admit(admission, request(score=lambda: (0, 100)))
        other = await admit(admission, request(score=lambda: (0, 100)))
        reader = asyncio.ensure_future(
            admit(admission, request(score=lambda: (0, 100), blocked=lambda: node["in_flight"]))
        )
        await asyncio.sleep(0)
        admission.release(writer)  # the wrong order: released first ...
        node["in_flight"] = False  # ... confirmed after
        await asyncio.sleep(0)
        stuck = not reader.done()
        admission.release(other)  # the next release (or an empty prefill) finally admits it
        await asyncio.sleep(0)
        admission.release(reader.result())
        return stuck

    assert asyncio.run(main()) is True


def test_speculation_takes_no_room_while_a_request_is_deferred() -> None:
    async def main() -> tuple[bool, bool]:
        admission = Admission(capacity=4, queue="fcfs", window=0)
        holder = await admit(admission, request(score=lambda: (0, 10)))
        free_before = request(lambda: (0, 10))
        assert admission.try_acquire(free_before)
        admission.release(free_before)
        reader = asyncio.ensure_future(
            admit(admission, request(score=lambda: (0, 10), blocked=lambda: True))
        )
        await asyncio.sleep(0)
        refused = not admission.try_acquire(request(lambda: (0, 10)))
        admission.release(holder)  # prefill empties: the deferred one is admitted
        await asyncio.sleep(0)
        admitted = reader.done()
        admission.release(reader.result())
        return refused, admitted

    assert asyncio.run(main()) == (True, True)


def test_the_prefill_token_budget_defaults_to_vllms_step_and_can_be_set() -> None:
    from ragcache_core.config import CacheConfig
    from ragcache_core.errors import ConfigError
    from ragcache_core.runtime.assembly import build_admission

    step = CacheConfig(max_num_batched_tokens=4096)
    assert build_admission(step).token_budget == 4096
    wider = step.with_(prefill_token_budget=8192)
    assert build_admission(wider).token_budget == 8192
    with pytest.raises(ConfigError, match="prefill_token_budget must be at least 1"):
        CacheConfig(prefill_token_budget=0)
