"""The gap to the optimum, live: the hits Belady would have had on the engine's own recent decode lookups.

What this is: `LiveGap(table)`, kept by the engine's slot cache (cache.py). Decode lookups are gathered in windows of
at most `window` lookups (GAP_WINDOW); a window also closes when a prompt has been read (end_prefill: the warm set
changes the pool outside any lookup) and when a request ends (generate.py). Closing replays the window's keys through
`BeladyPolicy` (MIN with bypass, the optimum for these lookups) in a SlotTable of the same capacity, pre-filled with
the keys resident when the window opened, and adds to three totals: lookups, hits (the engine's), belady_hits.
`totals()` returns them; a request's share is the difference of two readings (RequestStats.gap).
What this is not: a bound on prefill lookups (they never insert), or exact for a batched decode step, where the
engine serves an expert once per lookup call and counts its later pairs as its first was served; Belady counts each
pair on its own. With one sequence a decode lookup call has one pair per expert, and the two counts agree.
"""
from __future__ import annotations

from .policies import BeladyPolicy, SlotTable

GAP_WINDOW = 4096  # decode lookups per window: its Belady replay costs about as much as the lookups themselves took
# to account (one SlotTable access each), so the gap adds at most ~1x the cache's own Python bookkeeping


class LiveGap:
    def __init__(self, table: SlotTable, window: int = GAP_WINDOW):
        self.table, self.window = table, int(window)
        self.keys: list[int] = []
        self.hits = 0  # the engine's hits in the open window
        self.start: list[int] = []  # the keys resident when the window opened
        self.total = {"lookups": 0, "hits": 0, "belady_hits": 0}

    def before(self) -> None:
        """Call before a decode lookup's SlotTable.access: the first of a window notes the pool's contents."""
        if not self.keys:
            self.start = list(self.table.slot_of)

    def after(self, key: int, hit: bool) -> None:
        """Call after it, with the engine's verdict for this pair (counted as the cache counts it)."""
        self.keys.append(int(key))
        self.hits += bool(hit)
        if len(self.keys) >= self.window:
            self.close()

    def close(self) -> None:
        """Replay the open window through Belady from the same starting contents and add it to the totals."""
        if not self.keys:
            return
        keys, self.keys = self.keys, []
        cap = self.table.capacity
        best = SlotTable(cap, BeladyPolicy(cap, keys))
        best.prefill(self.start)
        for t, key in enumerate(keys):
            best.access(key, t)
        self.total["lookups"] += len(keys)
        self.total["hits"] += self.hits
        self.total["belady_hits"] += best.hits
        self.hits = 0

    def totals(self) -> dict:
        return dict(self.total)
