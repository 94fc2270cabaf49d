"""The off-policy bound: which policy version the inference server serves, and the gate on it.

Step semantics (docs/architecture.md#step-semantics): trainer step n turns θ_{n-1} into θ_n using the
rollouts of step n, and `broadcasts/step_n` holds θ_n (θ_0 = the base model, version 0). When the trainer
consumes step n's rollouts it holds θ_{n-1}, so a sample of version v is (n - 1) - v updates stale. With
`async_level` k the orchestrator keeps that gap at most k: before sampling step n it waits until the server
serves θ_{max(0, n-1-k)} or newer. k = 0 is fully synchronous on-policy training (step n samples θ_{n-1},
the newest policy that can exist while step n's batch is being made); k = 1 overlaps one trainer step with
one sampling step. (Reading the bound literally as θ_{n-k} would deadlock at k = 0: θ_n needs step n's
rollouts.)

A watcher task polls `broadcasts/` for STABLE steps and `transfers/` for collective offers (the trainer is
sending a step's weights: primejax.transports.weights.collective.offer) and tells the server to load each newer one; the gate
waits on the watcher's version. An offer of step N is preferred over a broadcast of the same step; a failed
collective update is never retried: the trainer writes `broadcasts/step_N` for it, which the next poll loads
(the filesystem fallback). A transport whose updates need the orchestrator's call each step brings a follower
(transports/weights/base.Follower), asked the same way: its step is preferred over a broadcast of the same step,
and a failed delivery is never retried. Time is injected (`sleep`, `clock`) so tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primejax.contracts.rundir import RunDir
from primejax.transports.weights.collective.offer import Offer, latest_offer, rendezvous_listening
from primejax.transports.weights.filesystem.broadcast import (
    broadcast_dir,
    is_stable,
    latest_stable_step,
    verify_broadcast,
)

if TYPE_CHECKING:
    from primejax.transports.weights.base import Follower

log = logging.getLogger(__name__)


@dataclass
class WeightUpdate:
    """One update of the served weights, as the run's timeline and server metrics show it: when the tracker
    started and finished it (its clock), the version, how it travelled, and each server's own load seconds."""

    step: int
    start: float
    end: float
    transport: str  # filesystem, collective, or a registered transport with a follower
    load_seconds: dict[str, float] = field(default_factory=dict)  # by server URL


def min_policy_version(step: int, async_level: int) -> int:
    """The oldest policy version step `step` (1-based) may sample from."""
    return max(0, step - 1 - async_level)


def staleness(step: int, policy_version: int) -> int:
    """Trainer updates between the sampling policy and the policy that trains on the sample."""
    return (step - 1) - policy_version


class PolicyTracker:
    def __init__(
        self,
        client: Any,
        run_dir: str | Path,
        *,
        poll_interval_s: float = 0.5,
        initial_version: int = 0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        latest_step: Callable[[Path], int | None] = latest_stable_step,
        offers: Callable[[Path, set[int]], Offer | None] = latest_offer,
        owner_alive: Callable[[Offer], Awaitable[bool]] | None = None,
        follower: tuple[str, Follower] | None = None,
    ):
        """`follower`: (transport name, its follower) for a transport whose updates the orchestrator delivers."""
        self.client = client
        self.run_dir = Path(run_dir)
        self.poll_interval_s = poll_interval_s
        self._version = initial_version
        self._sleep, self._clock, self._latest_step, self._offers = sleep, clock, latest_step, offers
        self._owner_alive = owner_alive or rendezvous_listening
        self._changed: asyncio.Condition | None = None
        self._lock: asyncio.Lock | None = None
        self.updates = 0
        self.update_seconds = 0.0
        self.collective_updates = 0
        self.failed_offers: set[int] = set()  # steps whose collective update failed (never retried)
        self._follower = follower
        self.failed_follows: set[int] = set()  # steps the follower failed to deliver (never retried)
        self.update_events: deque[WeightUpdate] = deque(maxlen=1000)  # the monitor drains it each step

    @property
    def version(self) -> int:
        return self._version

    def _sync(self) -> tuple[asyncio.Condition, asyncio.Lock]:
        # Created lazily so they bind to the running loop, not to whichever loop existed at construction.
        if self._changed is None:
            self._changed, self._lock = asyncio.Condition(), asyncio.Lock()
        return self._changed, self._lock

    async def sync_with_server(self) -> int:
        """Adopt the server's own version when it is newer (an orchestrator restarted next to a live server)."""
        self._version = max(self._version, int(await self.client.weights_version()))
        return self._version

    async def server_matches(self) -> bool:
        """Whether the server serves the tracked version now (False after it restarted on the base model)."""
        _, lock = self._sync()
        async with lock:  # not mid-update, when the server is legitimately one version ahead of the tracker
            return int(await self.client.weights_version()) == self._version

    async def resync(self) -> int:
        """Make the server serve the weights this tracker says it serves; return that version.

        Needed whenever the server may have lost them: a restarted server serves the base model, and a server
        shared with an earlier (killed) run may serve that run's newer weights, which a resumed run must not
        sample from. Version 0 reloads the base model; version v reloads `broadcasts/step_v`, or the newest
        STABLE broadcast if that one was pruned (newer weights never break the off-policy bound).
        """
        changed, lock = self._sync()
        async with lock:
            served = int(await self.client.weights_version())
            if served == self._version:
                return served
            if self._version == 0:
                await self.client.reload_weights()
            else:
                step = self._version if is_stable(broadcast_dir(self.run_dir, self._version)) else None
                step = step or self._latest_step(self.run_dir)
                if step is None or step < self._version:
                    raise RuntimeError(
                        f"the server lost policy version {self._version} and no broadcast of it or "
                        f"a newer one is left in {RunDir(self.run_dir).broadcasts()}"
                    )
                directory = broadcast_dir(self.run_dir, step)
                verify_broadcast(directory, check_hashes=False)
                await self.client.update_weights(str(directory), step)
                self._version = step
            log.warning(
                "inference server served version %d: set it back to version %d", served, self._version
            )
        async with changed:
            changed.notify_all()
        return self._version

    async def refresh(self) -> bool:
        """Load the newest offered or STABLE step into the server if it is newer than what it serves."""
        changed, lock = self._sync()
        async with lock:
            step = self._latest_step(self.run_dir)
            offer = await self._live_offer()
            follow = await self._follow_step()
            start = self._clock()
            if (
                follow is not None
                and follow > self._version
                and follow >= max(step or 0, offer.step if offer else 0)
            ):
                name, follower = self._follower
                try:
                    await follower.deliver(self.client, follow)
                except Exception as e:  # noqa: BLE001 - the step's broadcast, if any, is loaded instead
                    self.failed_follows.add(follow)
                    log.warning("%s update to step %d failed (%s)", name, follow, str(e)[:500])
                    return False
                step, transport = follow, name
            elif (
                offer is not None
                and offer.step > self._version
                and offer.step >= (step or 0)
                and offer.step not in self.failed_offers
            ):
                try:
                    await self.client.transfer_weights(offer.step, offer.init_info, offer.update_info)
                except Exception as e:  # noqa: BLE001 - the trainer falls back to broadcasts/step_N
                    self.failed_offers.add(offer.step)
                    log.warning(
                        "collective update to step %d failed (%s); waiting for its filesystem broadcast",
                        offer.step,
                        str(e)[:500],
                    )
                    return False
                step = offer.step
                self.collective_updates += 1
                transport = "collective"
            else:
                if step is None or step <= self._version:
                    return False
                directory = broadcast_dir(self.run_dir, step)
                try:
                    verify_broadcast(directory, check_hashes=False)
                    await self.client.update_weights(str(directory), step)
                except Exception as e:  # noqa: BLE001 - a bad or pruned broadcast is retried on the next poll
                    log.warning("loading weights of step %d failed: %s", step, e)
                    return False
                transport = "filesystem"
            end = self._clock()
            self.update_events.append(
                WeightUpdate(
                    step, start, end, transport, dict(getattr(self.client, "last_load_seconds", None) or {})
                )
            )
            self.update_seconds += end - start
            self.updates += 1
            self._version = step
        async with changed:
            changed.notify_all()
        log.info("inference server now serves policy version %d", step)
        return True

    async def _follow_step(self) -> int | None:
        """The follower's newest step not tried yet; a follower that cannot say counts as having none."""
        if self._follower is None:
            return None
        name, follower = self._follower
        try:
            step = await follower.newest()
        except Exception as e:  # noqa: BLE001 - asked again at the next poll
            log.warning("%s: finding its newest step failed (%s)", name, str(e)[:500])
            return None
        return None if step is None or step in self.failed_follows else int(step)

    async def _live_offer(self) -> Offer | None:
        """The newest offer not tried yet whose trainer is alive. An offer nobody listens for (a crashed trainer's
        leftover) is skipped at once: handing it to the server would pause it for the transfer timeout, and
        waiting on it would hide the live trainer's own offers of earlier steps."""
        while (offer := self._offers(self.run_dir, self.failed_offers)) is not None:
            if await self._owner_alive(offer):
                return offer
            self.failed_offers.add(offer.step)
            log.warning(
                "collective offer of step %d: no trainer listens at its rendezvous (a dead trainer's "
                "leftover); ignored",
                offer.step,
            )
        return None

    async def revive_replicas(self) -> list[str]:
        """Bring back servers the client marked down (several replicas) once they answer again: each is put on
        the tracked weights first, so a restarted replica (serving the base model) never samples under a
        newer version's tag. Returns the servers revived."""
        down = sorted(getattr(self.client, "down", ()))
        revived = []
        for url in down:
            if not await self.client.alive(url):
                continue
            _, lock = self._sync()
            async with lock:  # no update may land between loading this replica and routing to it
                try:
                    if int(await self.client.server_version(url)) != self._version:
                        if self._version == 0:
                            await self.client.update_one(url, None, 0)
                        else:
                            directory = broadcast_dir(self.run_dir, self._version)
                            verify_broadcast(directory, check_hashes=False)
                            await self.client.update_one(url, str(directory), self._version)
                    if int(await self.client.server_version(url)) != self._version:
                        raise RuntimeError("it does not report the tracked version after the load")
                except Exception as e:  # noqa: BLE001 - it stays down and is tried again on the next poll
                    log.warning(
                        "replica %s answers but could not be set to version %d: %s", url, self._version, e
                    )
                    continue
                await self.client.revive(url)
                revived.append(url)
        return revived

    async def check_replicas(self) -> list[str]:
        """Several replicas: mark down any server that answers with another version than the tracked one (it
        restarted between two requests, so no request failed to tell): it comes back through revive_replicas."""
        _, lock = self._sync()
        wrong = []
        async with lock:  # not mid-update, when a server is legitimately ahead
            for url in list(self.client.up_urls):
                try:
                    if int(await self.client.server_version(url)) != self._version:
                        wrong.append(url)
                except Exception:  # noqa: BLE001 - unreachable: the client marks it down on its own
                    continue
        for url in wrong:
            self.client.mark_down(url, f"it no longer serves policy version {self._version}")
        return wrong

    async def watch(self) -> None:
        """Run forever: poll for new broadcasts, check replicas and bring back those that returned (cancel the
        task to stop)."""
        replicated = len(getattr(self.client, "base_urls", ())) > 1
        while True:
            await self.refresh()
            if replicated:
                await self.check_replicas()
                if self.client.down:
                    await self.revive_replicas()
            await self._sleep(self.poll_interval_s)

    async def wait_for(self, min_version: int) -> float:
        """Block until the server serves `min_version` or newer; return the (clock) seconds spent waiting."""
        changed, _ = self._sync()
        start = self._clock()
        async with changed:
            await changed.wait_for(lambda: self._version >= min_version)
        return self._clock() - start
