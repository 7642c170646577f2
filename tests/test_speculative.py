"""Speculative decoding (engine/speculative.py): greedy output token for token that of plain decoding for every
family (recurrent state restored after rejections; with a slot pool) and every drafter (prompt lookup, a draft
model, the file's MTP block), the rejection rule's output distribution equal to the target's (a chi-square test),
the prompt-lookup drafter, and one-line CLI errors."""
import numpy as np
import pytest

import pymoe
from conftest import ARCHS, run_pymoe
from pymoe.engine.sampler import Sampler, SamplingParams
from pymoe.engine.speculative import NgramDrafter, Speculator

# A prompt that repeats itself, so that prompt lookup finds drafts some of which the model keeps and some not.
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 500, 12)] * 3


def greedy(engine, n, spec=None):
    return list(engine.generate(PROMPT, max_tokens=n, stop_at_eos=False, spec=spec))


class ScriptedDrafter:
    """Drafts the plain run's own next tokens, the third of each draft made wrong: every verification keeps two
    drafts and rejects one (when k >= 3), so both paths, and the recurrent state's restore, run at known places."""

    def __init__(self, want, n_vocab):
        self.want, self.n_vocab = want, n_vocab
        self.drafted = self.kept = 0  # what verification must report: all drafts, the ones before the wrong one

    def propose(self, history, k):
        j = len(history) - len(PROMPT)  # tokens generated so far
        d = list(self.want[j:j + k])
        if len(d) >= 3:
            d[2] = (d[2] + 1) % self.n_vocab
        self.drafted += len(d)
        self.kept += min(len(d), 2)
        return d


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_equals_plain_decoding(tiny_model, arch):
    path = tiny_model(arch, "f32")
    want = greedy(pymoe.load(path, n_ctx=128, cache_slots=6), 24)
    e = pymoe.load(path, n_ctx=128, cache_slots=6)  # a small slot pool: promotions during verification
    spec = Speculator(ScriptedDrafter(want, e.config.n_vocab), k=4)
    assert greedy(e, 24, spec) == want
    s = spec.stats
    d = spec.drafter
    assert (s.drafted, s.accepted) == (d.drafted, d.kept) and 0 < s.accepted < s.drafted
    if e.config.has_recurrent_state:
        assert s.rollbacks > 0  # the Gated DeltaNet state was restored and re-advanced
    assert e.cache.stats.counts["decode"]["promoted"] > 0
    e = pymoe.load(path, n_ctx=128, cache_slots=6)
    lookup = Speculator(NgramDrafter(), k=4)  # prompt lookup on the same prompt: the same tokens
    assert greedy(e, 24, lookup) == want and lookup.stats.steps > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_a_draft_model_identical_to_the_target_is_always_accepted(tiny_model, arch, tmp_path):
    """The draft model is the target's own file: its greedy drafts are the target's greedy tokens, bit for bit
    (decode == prefill), so every draft is kept; a draft model with other weights (another seed) agrees less."""
    from pymoe.demo.tinymodel import write_model

    path = tiny_model(arch, "f32")
    want = greedy(pymoe.load(path, n_ctx=128), 20)
    e = pymoe.load(path, n_ctx=128)
    same = e.speculator(f"draft:{path}", k=3)
    assert greedy(e, 20, same) == want
    assert same.stats.accepted == same.stats.drafted > 0
    other = str(tmp_path / "other.gguf")
    write_model(other, arch, "tiny", "f32", seed=1)
    e = pymoe.load(path, n_ctx=128)
    spec = e.speculator(f"draft:{other}", k=3)
    assert greedy(e, 20, spec) == want
    assert spec.stats.accepted < spec.stats.drafted


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    from pymoe.demo.tinymodel import write_model

    made = {}

    def make(arch):
        if arch not in made:
            made[arch] = str(tmp_path_factory.mktemp("mtp") / f"tiny-{arch}-mtp.gguf")
            write_model(made[arch], arch, "tiny", "f32", seed=0, mtp=True)
        return made[arch]
    return make


@pytest.mark.parametrize("arch", ["qwen3next", "glm4moe", "deepseek2"])
def test_mtp_drafts_keep_greedy_output(mtp_file, arch):
    """--spec mtp on files with an MTP block as the converters write it (make-tiny-model --mtp): the block runs
    (its own attention kind and KV cache, the experts read in place) and the output is the plain run's. The tiny
    heads are random, so their drafts are mostly rejected: every step is a rollback for the hybrid."""
    path = mtp_file(arch)
    want = greedy(pymoe.load(path, n_ctx=128, cache_slots=6), 16)
    e = pymoe.load(path, n_ctx=128, cache_slots=6)
    spec = e.speculator("mtp", 3)
    assert greedy(e, 16, spec) == want
    assert spec.stats.steps > 0 and spec.stats.drafted >= 2 * spec.stats.steps
    assert not e.model.hidden_taps  # the drafter unhooked itself at the end of the request


@pytest.mark.parametrize("arch", ["qwen3next", "deepseek2"])
def test_mtp_drafter_drafts_from_the_newest_pair(mtp_file, arch):
    """MtpDrafter.propose's first draft is the block's guess from the newest pair (h_(n-1), t_n), t_n the pending
    token, after all earlier pairs: the same argmax as the block run over all pairs at once (an independent forward
    of the trunk for the hidden states, a fresh block cache). Checked after the prompt (n pairs fed at once) and
    after a step that kept a draft (two new pairs)."""
    from pymoe.engine.mtp import MTPHead, MtpDrafter

    e = pymoe.load(mtp_file(arch), n_ctx=64)
    m, ids = e.model, list(PROMPT[:20])

    def reference(history):  # the block's guess after the last pair, everything from scratch
        kv, hs = m.new_kv(64), []
        m.hidden_taps[id(kv)] = lambda p0, h: hs.append(np.asarray(h))
        m.forward(history[:-1], kv, "prefill")
        del m.hidden_taps[id(kv)]
        head = MTPHead(m)
        logits, _ = head.forward(history[1:], hs[0], head.new_kv(64))
        return int(logits[-1].argmax())

    d = MtpDrafter(m, 64)
    kv = m.new_kv(64)
    d.attach(m, kv)
    m.forward(ids[:-1], kv, "prefill")  # the prompt; ids[-1] is the pending token
    first = d.propose(ids, 2)
    assert first[0] == reference(ids)
    m.forward([ids[-1], first[0]], kv, "decode")  # a step that kept the first draft: two new positions
    history = ids + [first[0], 7]
    assert d.propose(history, 1) == [reference(history)]
    d.detach(m, kv)


def test_mtp_drafter_keeps_the_pairs_of_a_reused_prefix(mtp_file):
    """A server slot's next job keeps a prefix of the last one's KV cache: its drafter keeps the block's entries of
    the pairs inside it (pair i needs t_(i+1): r kept positions keep pairs 0 .. r - 2), and a pair whose hidden state
    was fed and let go is skipped, the rest fed, instead of starting the block over."""
    from pymoe.engine.mtp import MtpDrafter

    e = pymoe.load(mtp_file("qwen3next"), n_ctx=64)
    m, ids = e.model, list(PROMPT[:30])
    d = MtpDrafter(m, 64)
    kv = m.new_kv(64)
    d.attach(m, kv)
    m.forward(ids[:-1], kv, "prefill")
    assert len(d.propose(ids, 2)) == 2 and d.entries == list(range(29))
    d.detach(m, kv)
    kv.clear()  # (a hybrid's slot recomputes from scratch; the block's entries are what this test is about)
    m.forward(ids[:12], kv, "prefill")
    d.attach(m, kv, reused=12)
    assert d.entries == list(range(11)) and d.kv.n == 11
    new = ids[:12] + [5, 6, 7]
    m.forward(new[12:-1], kv, "decode")
    assert len(d.propose(new, 2)) == 2 and d.entries == list(range(11)) + [12, 13]
    d.detach(m, kv)


@pytest.mark.parametrize("arch", ["qwen3next", "deepseek2"])
def test_mtp_drafts_for_several_sequences_at_once_are_each_ones_own(mtp_file, arch):
    """MtpDrafter.propose_many (the server's slots: one block forward for all sequences per drafted position, their
    pending pairs as a ragged batch) drafts for each sequence what its own `propose` drafts alone."""
    from pymoe.engine.mtp import MtpDrafter

    e = pymoe.load(mtp_file(arch), n_ctx=64)
    histories = [PROMPT[:9], PROMPT[3:20], PROMPT[::-1][:14]]

    def drafts(together):
        first = MtpDrafter(e.model, 64)
        ds = [first, first.fork(), first.fork()]
        for d, h in zip(ds, histories):
            kv = e.model.new_kv(64)
            d.attach(e.model, kv)
            e.model.forward(h[:-1], kv, "prefill")  # the hidden states of the sequence's positions
            d.detach(e.model, kv)
        ks = [3, 1, 2]
        if together:
            return MtpDrafter.propose_many(ds, histories, ks)
        return [d.propose(h, k) for d, h, k in zip(ds, histories, ks)]

    alone = drafts(False)
    assert [len(d) for d in alone] == [3, 1, 2] and drafts(True) == alone


@pytest.mark.parametrize("arch", ["qwen3next", "deepseek2"])
def test_mtp_block_reads_its_pairs_the_same_in_one_call_or_many(mtp_file, arch):
    """The MTP block's KV cache and positions: the logits of the pairs (h_i, t_(i+1)) computed in one call equal
    those computed one pair at a time (the block's own decode == prefill, bit for bit as for the trunk)."""
    from pymoe.engine.mtp import MTPHead

    e = pymoe.load(mtp_file(arch), n_ctx=64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, e.config.n_vocab, 10)
    h = rng.standard_normal((10, e.config.n_embd)).astype(np.float32)
    head = MTPHead(e.model)
    kv = head.new_kv(64)
    together, h_out = head.forward(tokens, h, kv)
    kv = head.new_kv(64)
    one = [head.forward(tokens[i:i + 1], h[i:i + 1], kv) for i in range(10)]
    np.testing.assert_array_equal(np.concatenate([lg for lg, _ in one]), together)
    np.testing.assert_array_equal(np.concatenate([hh for _, hh in one]), h_out)
    assert kv.n == 10


def split_mtp(src: str, dst_dir, drop: str = "", add: bool = False, change=None) -> str:
    """A file with an MTP block -> its trunk (tools/make-draft-model's cut, all layers) and beside it an MTP
    companion of that trunk (tinymodel.write_mtp_companion); returns the trunk's path. drop / add / change: a broken
    companion (a tensor left out, an extra tensor, a metadata key changed)."""
    from gguf import GGUFReader

    from pymoe.demo.tinymodel import write_first_layers, write_mtp_companion

    cfg = pymoe.load(src).config
    trunk = str(dst_dir / "trunk.gguf")
    write_first_layers(src, trunk, cfg.n_layers)
    r = GGUFReader(src)
    L = f"blk.{cfg.n_layers}."
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors
               if t.name.startswith(L) and t.name != drop]
    if add:
        tensors.append((L + "nextn.bogus.weight", np.ones(cfg.n_embd, np.float32), r.tensors[-1].tensor_type.F32))
    write_mtp_companion(trunk, str(dst_dir / "trunk.mtp.gguf"), tensors, change=change)
    return trunk


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_an_mtp_companion_drafts_as_the_block_inside_the_file(mtp_file, arch, tmp_path):
    """The MTP block moved into a companion GGUF (how the demo model's trained head ships: llama.cpp refuses
    extra tensors in a qwen3moe file): `--spec mtp` on the trunk finds it beside the file and drafts exactly as the
    block inside the original file does (same drafts kept, same tokens), and `mtp:FILE` names it."""
    path = mtp_file(arch)
    trunk = split_mtp(path, tmp_path)
    runs = []
    for file, spec in ((path, "mtp"), (trunk, "mtp"), (trunk, f"mtp:{tmp_path / 'trunk.mtp.gguf'}")):
        e = pymoe.load(file, n_ctx=128)
        sp = e.speculator(spec, 3)
        sp.backoff, sp.pause = False, 0  # draft on every step (the back-off depends on timing)
        runs.append((greedy(e, 16, sp), sp.stats.drafted, sp.stats.accepted))
    assert runs[0] == runs[1] == runs[2] and runs[0][1] > 0
    assert runs[0][0] == greedy(pymoe.load(path, n_ctx=128), 16)


@pytest.mark.parametrize("broken, msg", [
    (dict(drop="blk.2.nextn.hnorm.weight"), "missing tensor blk.2.nextn.hnorm.weight"),
    (dict(add=True), "tensor blk.2.nextn.bogus.weight is not part of an MTP block after layer 1"),
    (dict(change={"qwen3moe.rope.freq_base": 5000.0}), "metadata qwen3moe.rope.freq_base differs from"),
    (dict(change={"qwen3moe.block_count": 7}), "qwen3moe.block_count is 7, but an MTP companion of"),
    (dict(change={"tokenizer.ggml.tokens": None}), "metadata tokenizer.ggml.tokens differs from")])
def test_a_companion_that_does_not_fit_the_model_is_refused_in_one_line(mtp_file, tmp_path, broken, msg):
    trunk = split_mtp(mtp_file("qwen3moe"), tmp_path, **broken)
    r = run_pymoe("run", trunk, "-p", "hello", "-n", "4", "--spec", "mtp")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pymoe: error:") and "trunk.mtp.gguf" in last and msg in last, last


def heldout_ids(tokenizer, n: int) -> list:
    """The first n tokens of the demo corpus's first held-out file (pymoe/demo/train.py's split: never trained on)."""
    import os
    import sysconfig

    from pymoe.demo.train import is_heldout, stdlib_files

    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in stdlib_files(root) if is_heldout(f)]
    text = ""
    for f in files:  # enough text for n tokens (at ~3.7 bytes a token)
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text += fh.read()
        if len(text) > 8 * n:
            break
    return tokenizer.encode(text, add_bos=False)[:n]


def first_draft_agreement(engine, head, ids: list) -> tuple[float, int]:
    """Teacher-forced over `ids`: how often the head's greedy guess from (h_i, t_(i+1)) equals the model's own greedy
    choice after t_(i+1) (what greedy verification keeps as a first draft) -> (share, positions)."""
    from pymoe.engine.kv import KVCache

    m = engine.model
    kv = KVCache(m.cfg, len(ids))
    hidden = []
    m.hidden_taps[id(kv)] = lambda p0, h: hidden.append(np.asarray(h))
    trunk = np.asarray(m.forward(ids, kv, "prefill")).argmax(-1)  # [T]: the model's choice after position i
    del m.hidden_taps[id(kv)]
    guesses = head.forward(ids[1:], hidden[0][:-1], head.new_kv(len(ids)))[0].argmax(-1)  # [T - 1]: pair i -> t_(i+2)
    same = guesses[:-1] == trunk[1:-1]  # pair i against the model's choice at position i + 1
    return float(same.mean()), int(same.size)


def test_the_demo_models_trained_mtp_head_agrees_with_the_model_on_held_out_code(tmp_path):
    """The shipped MTP head (pymoe/demo/data/demo-moe.mtp.gguf, trained by pymoe/demo/train_mtp.py on the frozen
    trunk) on 257 tokens of held-out code, run by pymoe: its first draft agrees with the model's next greedy choice
    far more often than the untrained head's (the block training started from: the trunk's last layer, a random
    eh_proj). Bound: the difference must exceed 4 standard errors of a difference of two shares over n positions,
    each share's at most sqrt(0.25 / n) (p = 0.5, the worst case): 4 sqrt(0.5 / 256) = 0.18. A broken head path
    (concatenation order, a norm, the pair's position) falls to the untrained level. Then `--spec mtp` on the demo
    (k = 1) finds the head beside the model, keeps the plain greedy output, and its acceptance beats the untrained
    head's by the same bound over the drafts made (MtpDrafter's drafting path: which pair's output is the draft)."""
    from gguf import GGUFReader

    from pymoe import demo
    from pymoe.demo.tinymodel import write_mtp_companion
    from pymoe.engine.mtp import MTPHead

    e = pymoe.load(demo.DEMO_MODEL, n_ctx=512)
    ids = heldout_ids(e.tokenizer, 257)
    e.model.file.attach_mtp(demo.DEMO_MTP)
    trained, n = first_draft_agreement(e, MTPHead(e.model), ids)

    cfg, r = e.config, GGUFReader(demo.DEMO_MODEL)
    last, L = f"blk.{cfg.n_layers - 1}.", f"blk.{cfg.n_layers}."
    tensors = [(t.name.replace(last, L), np.array(t.data), t.tensor_type) for t in r.tensors
               if t.name.startswith(last)]
    F32 = r.tensors[0].tensor_type.F32
    rng = np.random.default_rng(0)
    tensors += [(L + "nextn.eh_proj.weight", (rng.standard_normal((cfg.n_embd, 2 * cfg.n_embd)) /
                                               np.sqrt(2 * cfg.n_embd)).astype(np.float32), F32)]
    tensors += [(L + f"nextn.{x}.weight", np.ones(cfg.n_embd, np.float32), F32)
                for x in ("enorm", "hnorm", "shared_head_norm")]
    untrained_path = str(tmp_path / "untrained.mtp.gguf")
    write_mtp_companion(demo.DEMO_MODEL, untrained_path, tensors)
    u = pymoe.load(demo.DEMO_MODEL, n_ctx=512)
    u.model.file.attach_mtp(untrained_path)
    untrained, _ = first_draft_agreement(u, MTPHead(u.model), ids)
    assert n == 255 and trained - untrained > 4 * np.sqrt(0.5 / n), (trained, untrained)

    plain = list(pymoe.load(demo.DEMO_MODEL, n_ctx=512).generate(ids[:64], max_tokens=64, stop_at_eos=False))
    runs = []
    for spec_name in ("mtp", f"mtp:{untrained_path}"):  # the head found beside the demo, then the untrained one
        e = pymoe.load(demo.DEMO_MODEL, n_ctx=512)
        spec = e.speculator(spec_name, 1)
        spec.backoff, spec.pause = False, 0
        assert list(e.generate(ids[:64], max_tokens=64, stop_at_eos=False, spec=spec)) == plain
        runs.append(spec.stats)
    n = min(st.drafted for st in runs)  # the acceptance of --spec mtp on the model's own continuation, same bound
    assert runs[0].acceptance - runs[1].acceptance > 4 * np.sqrt(0.5 / n), [(st.accepted, st.drafted) for st in runs]


def test_a_companion_passed_as_the_model_says_what_it_is():
    from pymoe import demo

    r = run_pymoe("run", demo.DEMO_MTP, "-p", "x", "-n", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(f"an MTP companion file (only an MTP block's tensors), not a "
                                                      f"model: pass the model, and this file as --spec mtp:{demo.DEMO_MTP}")


def test_rejection_rule_keeps_the_target_distribution():
    """Sampler.verify with a fixed draft: the tokens it returns are distributed as the sampler's own draws
    (Sampler.distribution), for a draft the target likes, one it does not, and one outside the candidates.
    Chi-square over the candidates at 40,000 draws: the 0.1% critical value (scipy-free: Wilson-Hilferty)."""
    logits = np.array([2.0, 1.5, 1.0, 0.2, -1.0, -3.0, -9.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    ids, probs = s.distribution(logits)
    p = np.zeros(logits.size)
    p[ids] = probs
    n = 40_000
    df = int((p > 0).sum()) - 1
    z = 3.09  # one-sided 0.1%
    critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    for draft in (0, 3, 6):
        counts = np.bincount([s.verify(logits, [], draft)[0] for _ in range(n)], minlength=logits.size)
        expected = n * p
        keep = expected > 0
        chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
        assert chi2 < critical, (draft, chi2, critical, counts, expected)
        assert counts[~keep].sum() == 0
    kept = [s.verify(logits, [], 1)[1] for _ in range(n)]
    assert abs(np.mean(kept) - p[1]) < 4 * np.sqrt(p[1] * (1 - p[1]) / n)  # kept with probability p(draft)


def test_greedy_verify_is_argmax_with_the_penalty():
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    logits = np.array([1.0, 1.5, 0.2], np.float32)
    assert s.verify(logits, [], 1) == (1, True)
    assert s.verify(logits, [1], 1) == (0, False)  # 1.5 / 2 < 1.0: the penalty sees the drafts as history


def test_ngram_drafter():
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the longest suffix match (1 2 3) wins
    assert d.propose([7, 1, 2, 8, 5, 2], 2) == [8, 5]  # n = 1: the latest 2 is followed by 8
    assert d.propose([1, 2, 3], 4) == []
    assert d.propose([4, 4, 4, 4], 2) == [4]  # the latest match's continuation, cut by the history's end


@pytest.mark.parametrize("spec, msg", [("bogus", "--spec must be ngram, draft:FILE, mtp or mtp:FILE"),
                                       ("mtp", "--spec mtp needs an MTP (nextn) block"),
                                       ("mtp:", "--spec mtp:FILE needs the MTP companion's GGUF file"),
                                       ("mtp:/nonexistent.gguf", "nonexistent.gguf: no such file"),
                                       ("draft:/nonexistent.gguf", "nonexistent.gguf")])
def test_spec_errors_are_one_line(tiny_model, spec, msg):
    r = run_pymoe("run", tiny_model("qwen3moe", "f32"), "-p", "hello", "-n", "4", "--spec", spec)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pymoe: error:") and msg in last


def test_run_cli_prints_the_speculation_line(tiny_model):
    r = run_pymoe("run", tiny_model("qwen3moe", "f32"), "-p", "a b c a b c a b", "-n", "12", "--spec", "ngram",
                  "--spec-k", "3")
    assert r.returncode == 0, r.stderr
    assert "speculation ngram k=3:" in r.stderr and "acceptance" in r.stderr


def test_trace_marks_verification_forwards_and_simulate_replays_them(tiny_model, tmp_path):
    """A traced speculative run: its verification forwards are phase 2 ("verify", counted in "decode" too), one
    row per position verified (drafts rejected included: their experts were read), and `pymoe simulate` replays
    the trace and counts them."""
    from pymoe.experts.simulate import sweep
    from pymoe.experts.trace import Trace

    e = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=128)
    rec = e.record_trace()
    spec = Speculator(NgramDrafter(), k=4)
    out = greedy(e, 24, spec)
    path = str(tmp_path / "spec.npz")
    rec.save(path)
    t = Trace.load(path)
    s = spec.stats
    assert t.tokens("verify") == s.drafted + s.steps  # each verification: the pending token and its drafts
    assert t.tokens("decode") == t.tokens("verify") + s.single_steps
    assert t.tokens("prefill") == len(PROMPT) and len(out) == 24
    assert np.unique(t.forward[t.rows("verify")]).size == s.steps
    assert "speculative verification forwards" in t.summary()
    (r,) = sweep(t, ["lru"], [4], ["global"], phase="verify")
    assert r.lookups == t.tokens("verify") * t.n_layers * t.k


@pytest.mark.parametrize("spec_name, policy", [("ngram", "lfru"), ("mtp", "lfru")])
def test_simulator_replays_a_speculative_run_with_the_engines_counts(spec_name, policy):
    """The demo model with 32 slots (25% of its experts) decodes with `--spec ngram` / `--spec mtp` (its shipped MTP
    head) and records a trace; replaying the trace with the same slots and policy counts the engine's decode hits,
    misses and promotions exactly. A verification forward is one lookup call per layer for several rows: an expert
    that a row promotes is, for a later row of the same call, served by the same miss path (its bytes land in the
    slot after the call's experts are computed), and an expert a row evicts is still read from its slot; the
    simulator counts the repeats as the first lookup in the call did. Before, it counted the table's answer (a hit
    on the just-promoted expert): here 679 / 795 hits against the engine's 671 / 670 of 752 / 944 lookups (ngram /
    mtp; issue 48 saw 66.5% against 60.2%)."""
    from pymoe import demo
    from pymoe.experts.profile import Profile
    from pymoe.experts.simulate import sweep

    e = pymoe.load(demo.DEMO_MODEL, n_ctx=512, cache_slots=32, policy=policy)
    rec = e.record_trace()
    spec = e.speculator(spec_name, 4)
    spec.backoff, spec.pause = False, 0  # draft every step: many verification forwards
    prompt = e.tokenizer.encode(demo.DEMO_PROMPT * 2)
    list(e.generate(prompt, max_tokens=48, stop_at_eos=False, spec=spec))
    d, trace = e.cache.stats.counts["decode"], rec.trace()
    assert trace.tokens("verify") > trace.tokens("decode") // 2 and spec.stats.accepted > 0
    empty = Profile(trace.n_layers, trace.n_experts, np.zeros((0, 2)), [])  # the engine had no --profile
    (sim,) = sweep(trace, [policy], [32], ["global"], profile=empty, phase="decode")
    assert (sim.lookups, sim.hits, sim.lookups - sim.hits, sim.promoted) == (
        d["lookups"], d["hits"], d["spill"] + d["cpu"], d["promoted"])
    # the case above arises: a verification call that looks an expert up in several rows, first as a miss
    L, E, k = trace.n_layers, trace.n_experts, trace.k
    verify = np.flatnonzero(trace.rows("verify"))
    repeats = sum(len(ids) - len(set(ids)) for f in np.unique(trace.forward[verify]) for layer in range(L)
                  for ids in [trace.experts[trace.forward == f, layer].reshape(-1).tolist()])
    assert repeats > 0 and 0 < d["promoted"] < d["spill"] + d["cpu"]


def test_server_speculates_when_one_slot_is_busy(tiny_model):
    """pymoe serve --spec ngram: a greedy completion through the official openai client is the text of plain
    decoding (the reference engine, f32 KV), and the server logged the request's speculation line."""
    import openai

    from pymoe.serve.app import BackgroundServer, create_app

    path = tiny_model("qwen3moe", "f32")
    text = "a b c d a b c d a b c d a b"
    want = "".join(pymoe.load(path, n_ctx=256).stream(text, max_tokens=24))
    logs = []
    app = create_app(pymoe.load(path, n_ctx=256), parallel=2, kv="f32", log=logs.append, spec="ngram", spec_k=4)
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt=text, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.usage.completion_tokens == 24
    assert any("speculation ngram k=4:" in line for line in logs), logs


@pytest.mark.parametrize("arch, spec", [("qwen3moe", "ngram"), ("qwen3next", "ngram"), ("qwen3next", "mtp"),
                                        ("deepseek2", "mtp"), ("qwen3moe", "draft")])
def test_several_busy_slots_speculate_in_one_batched_forward(tiny_model, mtp_file, arch, spec):
    """pymoe serve --parallel 3 --spec: three jobs at once, each slot drafting (prompt lookup; the MTP block, a
    drafter per slot over one shared block; a draft model, one per slot) and all verified in one forward
    (engine/batch.py forward_batch). Every job's greedy tokens are those of plain decoding one job at a time; the
    steps were batched three wide; drafts were verified; on the hybrid, rejected drafts were rolled back per slot."""
    from pymoe.serve.scheduler import Job, Scheduler

    path = mtp_file(arch) if spec == "mtp" else tiny_model(arch, "f32")
    spec = f"draft:{path}" if spec == "draft" else spec  # the target as its own draft: every draft kept
    prompts = [PROMPT, PROMPT[7:], PROMPT[::-1]]
    ref = pymoe.load(path, n_ctx=128)
    want = [list(ref.generate(p, max_tokens=20, stop_at_eos=False)) for p in prompts]
    with Scheduler(pymoe.load(path, n_ctx=128), parallel=3, kv="f32", spec=spec, spec_k=3) as sched:
        jobs = [sched.submit(Job(prompt_ids=p, max_tokens=20, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))) for p in prompts]
        for job in jobs:
            list(job.events(timeout=120))
    assert [job.generated for job in jobs] == want
    assert sched.max_batch == 3 and dict(sched.outcomes) == {"ok": 3}
    stats = [slot.spec.stats for slot in sched.slots]
    assert sum(st.steps for st in stats) > 0 and all(st.drafted >= st.accepted for st in stats)
    if spec.startswith("draft:"):
        assert all(st.accepted == st.drafted for st in stats)
    if arch == "qwen3next" and spec == "mtp":  # random heads: rejections, each one a state restore
        assert sum(st.rollbacks for st in stats) > 0
    assert not sched.model.hidden_taps  # every slot's drafter unhooked at its job's end


def test_a_draft_cut_from_the_model_loads_in_llama_cpp_and_drafts(tmp_path):
    """tools/make-draft-model: the demo model's first layer, byte for byte, with its head and tokenizer. llama.cpp
    loads it (the oracle for the file being well formed) and, on an F32 copy, computes pymoe's logits within the
    float bound; as a draft it keeps the demo's greedy output and is accepted far above chance."""
    import gguf

    from oracle import require_llama_cpp
    from pymoe import demo
    from pymoe.demo.tinymodel import write_f32_copy, write_first_layers

    src, dst = demo.demo_model(), str(tmp_path / "draft.gguf")
    write_first_layers(src, dst, 1)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    kept = {t.name: bytes(np.asarray(t.data).view(np.uint8)) for t in b.tensors}
    assert set(kept) == {t.name for t in a.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")}
    assert all(kept[t.name] == bytes(np.asarray(t.data).view(np.uint8)) for t in a.tensors if t.name in kept)

    llama_cpp = require_llama_cpp()
    f32 = str(tmp_path / "draft-f32.gguf")
    write_f32_copy(dst, f32)  # the same weights in float: llama.cpp then multiplies without 8-bit activations
    llm = llama_cpp.Llama(model_path=f32, n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0)
    ids = [5, 17, 42, 7, 99, 3]
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    ours = pymoe.load(dst, backend="reference").logits(ids)
    # tests/test_model_vs_llamacpp.py's float bound: 1e-5 of the logit scale (float32 summation order only)
    assert float(np.abs(ours - theirs).max()) <= 1e-5 * float(np.abs(theirs).max())

    e = pymoe.load(src)
    text = e.tokenizer.encode("The expert cache keeps the most used experts of every layer in fast memory and")
    want = list(e.generate(text, max_tokens=32, stop_at_eos=False))
    spec = e.speculator(f"draft:{dst}", k=4)
    assert list(e.generate(text, max_tokens=32, stop_at_eos=False, spec=spec)) == want
    # measured 13 / 64 = 0.20 on this prompt; a draft unrelated to the model is kept at chance, 1 / 4096
    assert spec.stats.acceptance > 0.1, spec.stats


def test_drafting_backs_off_when_it_is_slower_than_plain_steps(tiny_model):
    """The back-off: the first BACKOFF_CALIBRATE steps are plain (timed); after BACKOFF_WINDOW verifications that
    made fewer tokens per second than plain steps, BACKOFF_PAUSE plain steps; the output is the plain output either
    way. The timing rule is held to hand-made rates; the mechanism runs with the rule forced each way (on a tiny
    model a verification costs about what a plain step does, so real timings would decide by noise)."""
    from pymoe.engine.speculative import BACKOFF_CALIBRATE, BACKOFF_PAUSE, BACKOFF_WINDOW

    sp = Speculator(NgramDrafter())
    sp.rates = {"verify": [3.0, 3.0], "single": [1.0, 0.5]}  # 1 token/s against 2 tokens/s: slower
    assert sp._slower_than_plain()
    sp.rates = {"verify": [3.0, 1.0], "single": [1.0, 0.5]}  # 3 against 2: faster
    assert not sp._slower_than_plain()

    path = tiny_model("qwen3moe", "f32")
    n = BACKOFF_CALIBRATE + BACKOFF_WINDOW + BACKOFF_PAUSE + 4
    want = greedy(pymoe.load(path, n_ctx=128), n)

    class Wrong:
        def propose(self, history, k):
            j = len(history) - len(PROMPT)
            return [(t + 1) % 512 for t in want[j:j + k]]

    for slower, backoff in ((True, True), (False, True), (True, False)):
        spec = Speculator(Wrong(), k=2, backoff=backoff)
        spec._slower_than_plain = lambda: slower  # noqa: B023
        assert greedy(pymoe.load(path, n_ctx=128), n, spec) == want
        s = spec.stats
        assert s.accepted == 0
        if backoff and slower:
            assert s.pauses >= 1 and s.single_steps >= BACKOFF_CALIBRATE + BACKOFF_PAUSE
        elif backoff:
            assert s.pauses == 0 and s.single_steps <= BACKOFF_CALIBRATE + 1  # + the last token: no room to draft
        else:
            assert s.pauses == 0 and s.single_steps <= 1
