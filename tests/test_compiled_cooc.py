"""The compiled `cooc` (pymoe/experts/compiled_cooc.py) against its reference, CoocPolicy (policies.py): the same
answer to every call, through SlotTable as the engine and the simulator drive a policy."""
import numpy as np
import pytest

from pymoe.experts import compiled_cooc as cc
from pymoe.experts.policies import POLICIES, Admission, CompiledCoocPolicy, CoocPolicy, SlotTable, make_policy
from pymoe.experts.trace import synthetic_trace


def drive(policy, keys, slots, rng, admission=Admission(), prefill_keys=(), staged=0.0, places=0.0):
    """Every lookup of `keys` (engine order) through a SlotTable of `slots` under `policy` -> the list of what each
    call answered. With probability `staged` a lookup may not take a slot (insert=False: a prefill lookup), with
    probability `places` a random key is placed (SlotTable.place) or prefetched before it; the draws come from `rng`,
    so two policies driven with generators of one seed see the same calls."""
    table = SlotTable(slots, policy, admission)
    out = [table.prefill(prefill_keys)]
    top = int(max(keys)) + 1
    for t, key in enumerate(keys.tolist()):
        u = rng.random(3)
        if u[0] < places:
            other = int(rng.integers(top))
            out.append(table.place(other, t) if u[1] < 0.5 else table.prefetch(other, t, step=t // 4))
        out.append(table.access(key, t, insert=bool(u[2] >= staged), step=t // 4))
    out.append((table.hits, table.evictions, sorted(table.slot_of.items())))
    return out


WHOLE = dict(edges=(1,), weights=(1.0,), admit=1.0)  # a use weighs 1 for a token, then 0: scores tie often, and
# the victim among equal scores is the least recently used (the heap's second column)
CASES = [  # (slots, profile?, admission, staged, places, n_experts and k given?, the window's constants)
    (40, True, Admission(), 0.0, 0.0, True, {}),
    (12, False, Admission(), 0.2, 0.05, True, {}),
    (90, True, Admission(second_miss=True), 0.1, 0.1, True, {}),
    (25, True, Admission(max_inserts=2), 0.0, 0.1, True, {}),
    (30, False, Admission(), 0.0, 0.05, False, {}),  # without layers: the window alone
    (1, True, Admission(), 0.0, 0.0, True, {}),
    (0, False, Admission(), 0.0, 0.0, True, {}),
    (20, False, Admission(), 0.0, 0.0, False, WHOLE),
    (20, False, Admission(), 0.1, 0.05, True, dict(WHOLE, weight=0.0)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_compiled_cooc_decides_as_the_reference(case):
    """A synthetic trace (6 layers x 24 experts, top-3, locality and skew; 180 tokens, the first 20 a prompt), keys
    in the engine's order, through both policies: every call's answer equal (hit, slot, evicted key; placements and
    prefetches), the counters and the final residents, and every key's score equal to the last bit (the compiled
    arithmetic is the reference's, step for step). The cases cover a profile's prior and pre-fill, admission
    control, lookups that may not take a slot, placements, no layers (the window alone), one slot and none, and
    whole-number weights, whose tied scores leave the victim to the last use."""
    slots, profile, admission, staged, places, layered, window = CASES[case]
    tr = synthetic_trace(180, 6, 24, 3, seed=case, zipf=1.1, locality=0.5, prompt_len=20)
    keys, _ = tr.lookups(order="engine")
    per_token = 6 * 3
    prof = list(np.random.default_rng(case).permutation(6 * 24)) if profile else None
    kw = dict(profile_keys=prof, lookups_per_token=per_token, **(dict(n_experts=24, k=3) if layered else {}), **window)
    ref, fast = CoocPolicy(slots, **kw), CompiledCoocPolicy(slots, **kw)
    got = [drive(p, keys, slots, np.random.default_rng(100 + case), admission, prof[:slots] if prof else (),
                 staged, places) for p in (ref, fast)]
    assert got[0] == got[1]
    assert got[0][-1][0] > 0 or slots == 0  # the pool hit (none with no slots)
    if slots > 1:
        assert got[0][-1][1] > 0  # and evicted: victims were chosen
    seen = sorted(ref.score)
    assert [ref.score[k] for k in seen] == [fast.score(k) for k in seen]
    if layered and window.get("weight", 1.0):
        assert any(ref.bonus.values())  # the co-occurrence bonus was at work


def test_compiled_cooc_is_the_registered_default_and_takes_coocs_arguments():
    """`cooc` in the registry (what `pymoe run`, the planner and `pymoe simulate` build) is the compiled policy;
    CoocPolicy's keyword arguments reach it (the window's edges checked as WindowPolicy checks them)."""
    assert POLICIES["cooc"] is CompiledCoocPolicy
    p = make_policy("cooc", 8, profile_keys=[3, 1], lookups_per_token=4, n_experts=4, k=2)
    assert isinstance(p, CompiledCoocPolicy) and p.score(3) > p.score(1) > 0 == p.score(2)
    with pytest.raises(ValueError, match="edges"):
        CompiledCoocPolicy(2, edges=(3, 1), weights=(1.0, 0.5))


def test_compiled_cooc_memory_is_fixed_when_the_pool_rarely_evicts():
    """1,000,000 skewed lookups (tests/test_policies.py's rarely_evicting: 60 slots, 64 keys, one layer of 65
    experts, top-10) -> the heap's live length stays within HEAP_SLACK x (slots + 1) at every lookup, and no array
    grows past the keys seen (the state is O(slots + experts), allocated up front)."""
    from test_policies import rarely_evicting

    slots, n_keys, per_token = 60, 64, 10
    policy = make_policy("cooc", slots, profile_keys=list(range(n_keys)), lookups_per_token=per_token,
                         n_experts=n_keys + 1, k=per_token)
    sizes = (policy.heap.shape, policy.fifo.shape, policy.res.shape)

    class Lengths:  # rarely_evicting measures len() of what it is given: the heap's live entries
        def __len__(self):
            return int(policy.meta[cc.M_HEAP])

    longest, _ = rarely_evicting(policy, slots, n_keys, lambda: [Lengths()])
    assert longest <= 4 * (slots + 1)
    assert (policy.heap.shape, policy.fifo.shape, policy.res.shape) == sizes
    assert policy.sc.shape[0] <= 2 * (n_keys + 1) and policy.T.shape[0] == 1
