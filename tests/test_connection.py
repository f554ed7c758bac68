"""`ReplicaConnection` numbers its attempts on across the replica's failed incarnations.

A replica that refuses or dies right after connecting never fails to connect, so within
one incarnation there is only ever a first attempt; counting on from `failures` is what
lets the resolver (`runtime._replica_address`) replace a process that keeps failing.
"""

from __future__ import annotations

import asyncio

from controller._connection import ReplicaConnection


def test_attempts_count_on_from_the_failures_before_this_incarnation():
    async def run() -> list[int]:
        attempts: list[int] = []
        two = asyncio.Event()

        async def resolve(attempt: int) -> str:
            attempts.append(attempt)
            if len(attempts) == 2:
                two.set()
            raise RuntimeError("the process exited before it was ready")  # retried

        connection = ReplicaConnection(
            replica="r1",
            epoch=5,
            controller_epoch=1,
            resume=None,
            failures=4,
            resolve_address=resolve,
            on_connected=lambda nonce, ack: None,
            on_response=lambda response: None,
            on_failure=lambda reason: None,
        )
        connection.start()
        await asyncio.wait_for(two.wait(), 10)
        connection.close()
        return attempts

    assert asyncio.run(run())[:2] == [5, 6]
