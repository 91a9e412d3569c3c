"""Slot bookkeeping of one layer's device expert cache, and the eviction policies.

The same `SlotTable` drives the real offload engine (`engine.py`) and the trace-replay simulator
(`simulator.py`), so a policy behaves identically in both. A table knows which expert sits in each
slot, when each slot was last used (for LRU) and, for the prediction-aware policy, which experts the
current token's predictor says this layer will need.

Policies (chosen by name):
  lru         evict the least recently used unprotected slot.
  predictive  never evict an expert the current prediction for this layer names while another
              slot will do; among the rest, least recently used. A prefetch of a predicted expert
              therefore cannot push out another predicted one, and the prediction keeps useful
              experts resident across tokens.
  lfu         evict the unprotected slot whose expert the slow stream has demanded least often at
              this layer (counts survive eviction; ties: least recently used). A trained router's
              load is skewed even with a balancing loss, so past demand frequency predicts the next
              token's routing better than recency alone (measured on the demo's trace: 20% fewer
              loads than LRU, against Belady's 32%). Counts never decay: text whose topic shifts
              keeps its early favourites until the new ones overtake them.
  predictive_lfu  predictive's protection of the predicted experts, then lfu's order.
              Under both frequency policies a prefetch is also *admitted* only if its expert has
              been demanded at least as often as the victim it would evict (ties admit): a guess is
              a weaker claim than a demand count, and on a link-bound platform a wrong guess that
              evicts a favourite costs a transfer now and another when the favourite returns.
              Measured on the demo's trace (Mixtral costs, whole-expert link): m2r2 with
              predictive_lfu 0.86-1.03x over on-demand LRU without admission, 1.10-1.22x with it.
  belady      Belady's MIN: evict the unprotected slot whose expert is next needed furthest in the
              future (never again = infinitely far; ties: least recently used). It needs the future
              routing (`set_next_use`), so only the trace-replay simulator can run it; as demand
              paging it loads the fewest experts any policy can at this capacity, the ceiling every
              real policy is measured against. A prefetch under this policy is skipped when every
              victim is needed sooner than the expert it would bring in.
"""

from __future__ import annotations

from typing import Iterable, Optional

from m2r2_jax.errors import ConfigError

POLICIES = ("lru", "predictive", "lfu", "predictive_lfu", "belady")
FREQUENCY_POLICIES = ("lfu", "predictive_lfu")  # evict by demand count
PREDICTIVE_POLICIES = ("predictive", "predictive_lfu")  # protect the current prediction
FUTURE_POLICIES = ("belady",)  # need the future routing: simulator only
EMPTY = -1


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ConfigError(f"cache policy {name!r} is invalid: expected one of {', '.join(POLICIES)}")
    return name


class SlotTable:
    """Which expert occupies each of `capacity` slots of one layer, with recency and predictions."""

    def __init__(self, capacity: int, policy: str = "lru"):
        if capacity <= 0:
            raise ConfigError(f"cache capacity={capacity} is invalid: expected a positive number of expert slots")
        self.capacity = capacity
        self.policy = check_policy(policy)
        self.expert = [EMPTY] * capacity
        self.last_use = [-1.0] * capacity
        self.predicted: frozenset = frozenset()
        self.next_use = None  # belady: expert -> when it is next needed (inf: never)
        self.uses: dict = {}  # lfu: expert -> how often the slow stream demanded it at this layer
        self._clock = 0

    # -- queries ---------------------------------------------------------------------------
    def slot_of(self, e: int) -> Optional[int]:
        try:
            return self.expert.index(e)
        except ValueError:
            return None

    def resident(self) -> set:
        return {e for e in self.expert if e != EMPTY}

    # -- updates ---------------------------------------------------------------------------
    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def touch(self, slot: int) -> None:
        self.last_use[slot] = self.tick()

    def count_uses(self, experts: Iterable[int]) -> None:
        """The slow stream demands `experts` now (lfu's counts; guesses and prefetches do not count)."""
        for e in experts:
            self.uses[int(e)] = self.uses.get(int(e), 0) + 1

    def set_prediction(self, experts: Iterable[int]) -> None:
        self.predicted = frozenset(int(e) for e in experts)

    def set_next_use(self, next_use) -> None:
        """belady: `next_use[e]` is when expert e is next demanded at this layer, in any increasing
        unit (the simulator uses token indices; the current token's demand is "now"), inf if never."""
        self.next_use = next_use

    def _next_use(self, e: int) -> float:
        if self.next_use is None:
            raise ConfigError("cache policy 'belady' needs each expert's next-use time (set_next_use): it "
                              "needs the future routing, so only the trace-replay simulator can run it")
        return float(self.next_use[e])

    def victim(self, protect: Iterable[int] = (), incoming: Optional[int] = None) -> Optional[int]:
        """Slot to overwrite, or None when every slot holds a protected expert. `incoming` (the
        expert a prefetch would bring in; None for a demand): also None when the policy does not
        admit it over the chosen victim: belady when every candidate is needed no later than
        `incoming` (evicting it could only add a load), the frequency policies when the victim has
        been demanded more often than `incoming`."""
        protect = set(protect)
        free = [s for s, e in enumerate(self.expert) if e == EMPTY]
        if free:
            return free[0]
        candidates = [s for s, e in enumerate(self.expert) if e not in protect]
        if not candidates:
            return None
        if self.policy == "belady":
            # furthest next use first; among equals (e.g. never needed again) the least recently used
            s = max(candidates, key=lambda s: (self._next_use(self.expert[s]), -self.last_use[s]))
            if incoming is not None and self._next_use(self.expert[s]) <= self._next_use(incoming):
                return None
            return s
        if self.policy in PREDICTIVE_POLICIES:
            unpredicted = [s for s in candidates if self.expert[s] not in self.predicted]
            candidates = unpredicted or candidates
        if self.policy in FREQUENCY_POLICIES:
            s = min(candidates, key=lambda s: (self.uses.get(self.expert[s], 0), self.last_use[s]))
            if incoming is not None and self.uses.get(self.expert[s], 0) > self.uses.get(int(incoming), 0):
                return None
            return s
        return min(candidates, key=lambda s: self.last_use[s])

    def install(self, slot: int, e: int) -> None:
        self.expert[slot] = int(e)
        self.touch(slot)
