"""FairTurns on its own (engram/sessions.py), with asyncio tasks: the replay turns of waiting Resumes go
round-robin between tenants, first come, first served within one, and a waiter cancelled while it waits, or as
it is handed a turn, loses no turn and leaves the counts where they were. A single FIFO queue let one tenant's
burst of Resumes run before another tenant's single Resume."""

from __future__ import annotations

import asyncio

import pytest

from engram.sessions import FairTurns


async def queue(turns: FairTurns, order: list[str], tenant: str, name: str) -> asyncio.Task[None]:
    """A waiter that notes its name when handed a turn (and keeps it until given back); returns once queued."""
    async def wait() -> None:
        await turns.take(tenant)
        order.append(name)

    before = turns.waiting
    task = asyncio.create_task(wait())
    await asyncio.sleep(0)
    assert turns.waiting == before + 1
    return task


async def hand_out(turns: FairTurns, order: list[str], n: int) -> None:
    """Give back n turns one by one, each once its waiter has taken it."""
    for _ in range(n):
        seen = len(order)
        turns.give_back()
        while len(order) == seen:
            await asyncio.sleep(0)


async def test_waiting_tenants_take_turns_round_robin_each_first_come_first_served() -> None:
    turns, order = FairTurns(1), []
    await turns.take("a")  # the running one
    waiters = [await queue(turns, order, "a", f"a{i}") for i in range(1, 5)]
    waiters.append(await queue(turns, order, "b", "b1"))
    waiters.append(await queue(turns, order, "c", "c1"))
    waiters.append(await queue(turns, order, "b", "b2"))
    assert turns.waiting == 7 and turns.waiting_of("a") == 4 and turns.waiting_of("b") == 2
    await hand_out(turns, order, 7)
    await asyncio.gather(*waiters)
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    turns.give_back()
    assert turns.waiting == 0 and not turns.tenants_waiting and not turns.busy()


async def test_one_tenant_is_served_first_come_first_served() -> None:
    turns, order = FairTurns(1), []
    await turns.take()
    waiters = [await queue(turns, order, "", str(i)) for i in range(5)]
    await hand_out(turns, order, 5)
    await asyncio.gather(*waiters)
    assert order == ["0", "1", "2", "3", "4"]


async def test_a_free_turn_goes_at_once_and_a_given_back_one_goes_to_a_waiter_before_a_later_caller() -> None:
    turns, order = FairTurns(2), []
    await turns.take("a")
    await turns.take("b")
    assert turns.busy() and turns.waiting == 0
    waiter = await queue(turns, order, "a", "a1")
    turns.give_back()
    assert turns.busy(), "the turn given back was free for a later caller to take before the waiter"
    await waiter
    assert order == ["a1"]


async def test_waiters_cancelled_while_waiting_or_as_their_turn_is_handed_over_lose_no_turn() -> None:
    turns, order = FairTurns(1), []
    await turns.take("a")
    a1, a2, a3 = [await queue(turns, order, "a", f"a{i}") for i in (1, 2, 3)]
    b1, b2 = [await queue(turns, order, "b", f"b{i}") for i in (1, 2)]
    a2.cancel()  # while it waits
    with pytest.raises(asyncio.CancelledError):
        await a2
    assert turns.waiting == 4 and turns.waiting_of("a") == 2
    turns.give_back()  # hands a1 its turn...
    a1.cancel()  # ...and a1 is cancelled before it runs: the turn goes on to b1
    with pytest.raises(asyncio.CancelledError):
        await a1
    while order != ["b1"]:
        await asyncio.sleep(0)
    assert turns.tenants_waiting == ["a", "b"]  # b was served: a's turn comes first
    a3.cancel()  # cancelled, and passed over by a give_back before its task runs to leave the queue
    turns.give_back()
    with pytest.raises(asyncio.CancelledError):
        await a3
    await b2
    assert order == ["b1", "b2"]
    assert turns.waiting == 0 and not turns.tenants_waiting
    turns.give_back()  # b2's
    assert not turns.busy()
    await turns.take("c")  # the one turn is free again, not lost and not doubled
    assert turns.busy()
