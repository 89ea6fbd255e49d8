"""`PrefixCache`: finished sequences' K/V kept in spare KV-cache slots for their conversation's next turn.

Agent loops send each turn as a token-in-token-out prompt that extends the previous turn exactly (previous
prompt + response + new messages), and the router keeps a conversation on one replica. Keeping a finished
sequence's K/V lets that next turn prefill only its new tokens instead of the whole conversation again.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridflow.engines.rollout.native.kv_cache import KVCache

MIN_REUSED_TOKENS = 8
"""Shorter shared prefixes are prefilled again with the batch (a reuse costs its own forward)."""


class PrefixCache:
    """Parked caches of finished sequences, in dedicated slots of a `KVCache` that decoding never uses.

    Holds, per parking slot, the token ids whose K/V the slot holds (the finished sequence's prompt and
    response, less the last token, which was never fed). A full cache evicts the least recently parked.
    Its contents are valid only for the weights they were computed with: the owner drops it (ends the
    decode run) before weights change.
    """

    def __init__(self, cache: KVCache, slots: range) -> None:
        """`slots`: the cache slots reserved for parking (may be empty: prefix reuse off)."""
        self.cache = cache
        self.free = list(slots)
        self.parked: OrderedDict[int, list[int]] = OrderedDict()  # slot -> cached token ids, oldest first

    def park(self, slot: int, token_ids: list[int]) -> None:
        """Copy `slot`'s first len(token_ids) positions into a parking slot (evicting the oldest if full)."""
        if len(token_ids) < MIN_REUSED_TOKENS or not (self.free or self.parked):
            return
        if not self.free:
            evicted, _ = self.parked.popitem(last=False)
            self.free.append(evicted)
        target = self.free.pop()
        self.cache.copy_slot(slot, target, len(token_ids))
        self.parked[target] = token_ids

    def longest_prefix(self, prompt: list[int]) -> tuple[int, int] | None:
        """(parking slot, tokens to reuse) of the longest parked sequence that `prompt` starts with, taken out
        of the parking; None if none is long enough. At least one prompt token is left to feed."""
        best, best_len = None, 0
        for slot, token_ids in self.parked.items():
            if len(token_ids) > best_len and prompt[: len(token_ids)] == token_ids:
                best, best_len = slot, len(token_ids)
        reused = min(best_len, len(prompt) - 1)
        if best is None or reused < MIN_REUSED_TOKENS:
            return None
        del self.parked[best]
        self.free.append(best)  # free again once its positions are copied out (before the next park)
        return best, reused
