"""The suffix drafter (drafting/suffix.py over drafting/suffix_index.py): the index in plain Python,
then through the engine (greedy identity alone and in hybrid, drafts actually accepted), its config
keys, and the worker-wide cache's memory bound under thousands of finished sequences."""
import random

import pytest
import torch

from conftest import greedy_reference, make_engine, run_requests
from pipeline.errors import ConfigError
from pipeline.job.config import config_hash, hashed_tree, load_config
from pipeline.engine import SamplingParams, SuffixDrafter, SuffixParams
from pipeline.engine.core.request import Sequence
from pipeline.engine.drafting.suffix_index import RequestIndex, SuffixCache, SuffixTrie

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def seq_of(prompt, output=(), params=GREEDY) -> Sequence:
    return Sequence("r", list(prompt), params, 0, list(output))


def all_paths(trie: SuffixTrie) -> dict[tuple, int]:
    out, stack = {}, [((), 0)]
    while stack:
        path, node = stack.pop()
        for tok, child in trie.children[node].items():
            out[path + (tok,)] = trie.count[child]
            stack.append((path + (tok,), child))
    return out


def brute_counts(texts, depth) -> dict[tuple, int]:
    counts = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(i + depth, len(text)) + 1):
                counts[tuple(text[i:j])] = counts.get(tuple(text[i:j]), 0) + 1
    return counts


# ---- the index --------------------------------------------------------------------------------------
def test_counts_match_brute_force_after_adds_and_removes():
    rng = random.Random(0)
    texts = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(20)]
    trie = SuffixTrie(max_depth=4)
    for t in texts:
        trie.add(t)
    assert all_paths(trie) == brute_counts(texts, 4)
    for t in texts[:12]:
        trie.remove(t)
    assert all_paths(trie) == brute_counts(texts[12:], 4)      # zero-count nodes are pruned
    assert trie.num_nodes == 1 + len(brute_counts(texts[12:], 4))
    for t in texts[12:]:
        trie.remove(t)
    assert trie.num_nodes == 1 and not trie.children[0]


def test_longest_match_and_most_frequent_continuation():
    trie = SuffixTrie(max_depth=8)
    trie.add([1, 2, 3, 4, 9, 2, 3, 5, 7, 3, 5, 8, 8, 2, 3, 5])
    # [2, 3] is followed by 4, 5, 5: the longest matched suffix of [..., 6, 2, 3] is [2, 3]
    length, node = trie.longest_match([6, 2, 3], max_len=7)
    assert length == 2 and node is trie.find([2, 3])
    assert trie.walk(node, limit=1, min_prob=0.0).tokens == [5]
    # [9, 2, 3] occurs once, followed by 5 7: a longer match wins over the more frequent [2, 3]
    assert trie.longest_match([9, 2, 3], max_len=7)[0] == 3
    assert trie.walk(trie.find([9, 2, 3]), limit=2, min_prob=0.0).tokens == [5, 7]
    # the last occurrence of [2, 3, 5] ends the text: without a continuation it is not counted
    assert trie.count[trie.find([2, 3, 5])] == 2
    walk = trie.walk(trie.find([2, 3, 5]), limit=1, min_prob=0.0)
    tokens, score = walk.tokens, walk.score
    assert tokens == [7] and score == pytest.approx(1.0)


def test_draft_length_from_confidence():
    trie = SuffixTrie(max_depth=10)
    for tail in ([5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 9], [5, 9, 9]):
        trie.add([1, 2, 3, 4] + tail)
    params = SuffixParams(max_depth=10, min_match=1, min_prob=0.0, max_spec_factor=10.0)
    # after [3, 4]: 5 (1.0), then 6 (3/5 = 0.6), then 7 (0.6 * 2/3 = 0.4)
    tokens, score = trie.draft([0, 3, 4], k=5, params=params)
    assert tokens == [5, 6, 7] and score == pytest.approx(1.0 + 0.6 + 0.4)
    assert trie.draft([0, 3, 4], 5, SuffixParams(10, 1, min_prob=0.5, max_spec_factor=10.0))[0] == [5, 6]
    assert trie.draft([0, 3, 4], 5, SuffixParams(10, 1, min_prob=0.7, max_spec_factor=10.0))[0] == [5]
    assert trie.draft([0, 3, 4], 2, params)[0] == [5, 6]                                   # engine's k
    assert trie.draft([0, 3, 4], 5, SuffixParams(10, 1, 0.0, max_spec_factor=0.5))[0] == [5]   # 0.5 * 2
    assert trie.draft([0, 7, 4], 5, SuffixParams(10, 1, 0.0))[0] == [5]                    # 1.0 x match [4]
    assert trie.draft([0, 7, 4], 5, SuffixParams(10, min_match=2, min_prob=0.0))[0] == []  # too short
    assert trie.draft([0, 0, 42], 5, params) == ([], 0.0)                                  # no match


def test_sampled_walk_draws_children_in_proportion_and_keeps_q():
    trie = SuffixTrie(max_depth=10)
    for tail in ([5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 9], [5, 9, 9]):
        trie.add([1, 2, 3, 4] + tail)
    node = trie.find([3, 4])
    # after [3, 4]: 5 always; then 6 for u < 3/5, else 9; after 5 6: 7 for u < 2/3, else 8
    walk = trie.walk(node, 3, 0.0, uniforms=[0.99, 0.1, 0.9])
    assert walk.tokens == [5, 6, 8]
    assert [(t, pytest.approx(p)) for t, p in walk.q] == [([5], [1.0]), ([6, 9], [0.6, 0.4]),
                                                            ([7, 8], [2 / 3, 1 / 3])]
    assert trie.walk(node, 3, 0.0, uniforms=[0.0, 0.6, 0.0]).tokens == [5, 9, 9]       # u = 3/5: 9
    assert trie.walk(node, 3, 0.0, uniforms=[0.0, 0.5999, 0.0]).tokens == [5, 6, 7]
    # the stop rule is the greedy walk's (the running product of each node's top share):
    assert trie.walk(node, 3, 0.5, uniforms=[0.0, 0.0, 0.0]).tokens == [5, 6]          # 1, 0.6, 0.4
    sampled = trie.walk(node, 3, 0.5, uniforms=[0.0, 0.9, 0.0])                         # 1, 0.6, 0.6
    assert sampled.tokens == [5, 9, 9] and sampled.score == pytest.approx(2.2)


def test_drafter_samples_for_sampled_sequences_only():
    hot = SamplingParams(max_tokens=8, temperature=0.8)
    for method in ("probabilistic", "greedy"):
        drafter = SuffixDrafter(SuffixParams(min_match=1, min_prob=0.0, max_spec_factor=4.0, sample_method=method))
        for tail in ([5, 6], [5, 6], [5, 9]):
            drafter.release(seq_of([1, 2, 3, 4] + tail))
        seqs = [seq_of([0, 3, 4]), seq_of([0, 3, 4], params=hot)]
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        batch = drafter.propose(seqs, [2, 2], gens)
        if method == "greedy":
            assert batch.draft_probs is None and batch.proposals == [[5, 6], [5, 6]]
            continue
        q = batch.draft_probs                                 # greedy rows one-hot, the sampled ones spread
        entries = sorted(zip(q.row.tolist(), q.token.tolist(), [round(p, 4) for p in q.prob.tolist()]))
        second = batch.proposals[1][1]
        assert batch.proposals[0] == [5, 6] and batch.proposals[1][0] == 5 and second in (6, 9)
        assert entries == [(0, 5, 1.0), (1, 6, 1.0), (2, 5, 1.0), (3, 6, 0.6667), (3, 9, 0.3333)]
        # the draws come from the sequence's own generator: the same seed, the same draft
        again = drafter.propose(seqs, [2, 2], [torch.Generator().manual_seed(s) for s in (1, 2)])
        assert again.proposals == batch.proposals


def test_request_index_grows_incrementally():
    rng = random.Random(1)
    text = [rng.randrange(4) for _ in range(60)]
    index = RequestIndex(max_depth=5)
    pos = 0
    while pos < len(text):
        step = rng.randrange(1, 5)
        index.append(text[pos:pos + step])
        pos += step
        assert all_paths(index) == brute_counts([text[:pos]], 5)
    assert index.num_tokens == len(text)


def test_drafter_follows_commits_and_releases_into_the_cache():
    drafter = SuffixDrafter(SuffixParams(min_match=2, min_prob=0.6, max_spec_factor=4.0))
    seq = seq_of([1, 2, 3, 4, 5, 1, 2])
    assert drafter.lookup(seq, 3).tokens == [3, 4, 5]            # from its own prompt
    seq.output_ids += [3, 4, 7, 1, 2]                     # committed: 1 2 -> 3 twice
    drafter.on_commit([seq])
    assert drafter._own[seq].num_tokens == seq.num_tokens
    assert drafter.lookup(seq, 3).tokens == [3, 4]               # 3 4, then 5 or 7: 1/2 each, below min_prob
    drafter.release(seq)
    assert seq not in drafter._own and drafter.cache.num_tokens == seq.num_tokens
    other = seq_of([9, 9, 4, 7])                          # nothing in its own history: from the cache
    assert drafter.lookup(other, 2).tokens == [1, 2]
    assert drafter.lookup(seq_of([0, 6]), 4).tokens == []


def test_own_history_and_cache_compete_on_score():
    drafter = SuffixDrafter(SuffixParams(min_match=1, max_spec_factor=4.0))
    for _ in range(3):
        drafter.release(seq_of([1, 2, 3, 4, 5, 6]))
    seq = seq_of([7, 1, 2, 9, 1, 2])
    assert drafter.lookup(seq, 4).tokens == [3, 4, 5, 6]         # the cache's score 4 beats its own 3:
    assert drafter._own[seq].draft(seq.all_ids(), 4, drafter.params) == ([9, 1, 2], 3.0)
    drafter.release(seq_of([1, 2, 7]))
    assert drafter.lookup(seq, 4).tokens == [9, 1, 2]            # now 3, 0.75 + 4, 0.75 ...: 3.0 vs 3.0


def test_cache_memory_stays_bounded_under_thousands_of_sequences():
    rng = random.Random(2)
    cap, depth = 2000, 8
    cache = SuffixCache(max_depth=depth, max_tokens=cap)
    template = [rng.randrange(1000) for _ in range(30)]
    peak = 0
    for i in range(3000):
        text = template + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        cache.add(text)
        assert cache.num_tokens <= cap
        peak = max(peak, cache.trie.num_nodes)
    assert peak <= cap * depth + 1 and len(cache.trie.count) <= cap * depth + 1   # ids reused, lists bounded
    kept = list(cache._texts)
    assert all_paths(cache.trie) == brute_counts(kept, depth)        # evicted sequences left no trace
    assert 20 < cache.num_sequences < 100
    cache.add(list(range(5000)))                                     # longer than the cap: its tail
    assert cache.num_sequences == 1 and cache.num_tokens == cap
    assert cache.trie.num_nodes == 1 + len(brute_counts([list(range(3000, 5000))], depth))


def test_cache_off_and_zero_length():
    drafter = SuffixDrafter(SuffixParams(max_cached_tokens=0))
    drafter.release(seq_of([1, 2, 3, 1, 2, 3]))
    assert drafter.cache.num_tokens == 0
    assert drafter.lookup(seq_of([1, 2]), 4).tokens == []
    assert drafter.lookup(seq_of([1, 2, 3, 1, 2]), 0).tokens == []
    batch = drafter.propose([seq_of([1, 2, 3, 1, 2]), seq_of([5])], [3, 3], [None, None])
    assert batch.num_draft == [2, 0] and batch.tokens(0) == [3, 1] and batch.draft_probs is None   # 1 x match [1, 2]


def test_running_texts_are_indexed_as_they_grow_and_finish_in_order():
    rng = random.Random(5)
    depth, cap = 6, 400
    cache = SuffixCache(max_depth=depth, max_tokens=cap)
    running = {k: [] for k in range(3)}
    finished = []
    for step in range(200):
        for key in list(running):
            new = [rng.randrange(6) for _ in range(rng.randrange(0, 4))]
            running[key] += new
            cache.extend(key, new)
        if step % 7 == 6:                                    # one finishes, another starts
            key = min(running)
            cache.finish(key, running.pop(key))
            finished.append(key)
            running[max(running) + 1 if running else step] = []
        indexed = [t for k, t in running.items() if cache.is_indexed(k)]
        assert cache.num_tokens <= cap and cache.num_running_tokens == sum(map(len, indexed))
        assert all_paths(cache.trie) == brute_counts(list(cache._texts) + indexed, depth)
    assert len(finished) > 20 and cache.num_sequences < len(finished)   # the oldest finished were evicted


def test_running_texts_leave_when_the_cap_is_full_of_them_and_join_when_finished():
    cache = SuffixCache(max_depth=4, max_tokens=10)
    cache.add([9, 9, 9])
    cache.extend("a", [1, 2, 3, 4, 5, 6])
    cache.extend("b", [7, 8, 1])                             # evicts the finished [9, 9, 9] to fit
    assert cache.num_sequences == 0 and cache.num_tokens == 9
    cache.extend("b", [2, 3])                                # 11 > 10 and no finished text left: b leaves
    assert not cache.is_indexed("b") and cache.is_indexed("a") and cache.num_tokens == 6
    cache.add([0, 0, 0, 0, 0])                               # finished: at most what fits beside a
    assert list(cache._texts) == [[0, 0, 0, 0]] and cache.num_tokens == 10
    cache.extend("c", [5])                                   # a running text evicts finished ones
    assert list(cache._texts) == [] and cache.num_tokens == 7 and cache.num_running_tokens == 7
    cache.finish("c", [5])
    cache.extend("b", [4])                                   # stays out until it finishes
    assert all_paths(cache.trie) == brute_counts([[1, 2, 3, 4, 5, 6], [5]], 4) and list(cache._texts) == [[5]]
    cache.finish("b", [7, 8, 1, 2, 3, 4])                    # joins as a finished text: what fits beside a
    assert cache.num_tokens == 10 and list(cache._texts) == [[1, 2, 3, 4]]           # (c's [5] evicted)
    cache.finish("a", [1, 2, 3, 4, 5, 6, 0])                 # its last token first makes room (evicts b)
    assert list(cache._texts) == [[1, 2, 3, 4, 5, 6, 0]] and cache.num_tokens == 7
    assert all_paths(cache.trie) == brute_counts([[1, 2, 3, 4, 5, 6, 0]], 4)


def test_counts_less_a_subset_trie_are_the_other_texts_counts():
    """draft(..., minus=own) over a trie of others + own sees exactly a trie of the others."""
    rng = random.Random(7)
    depth = 6
    for trial in range(30):
        texts = [[rng.randrange(5) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
        own_text = texts[0]
        everything, others, own = SuffixTrie(depth), SuffixTrie(depth), RequestIndex(depth)
        for t in texts:
            everything.add(t)
        for t in texts[1:]:
            others.add(t)
        own.append(own_text)
        for _ in range(20):
            context = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            assert everything.longest_match(context, 5, own)[0] == others.longest_match(context, 5)[0]
            node = everything.find(context)
            want = others.find(context)
            if node is None or want is None:
                continue
            got = everything.walk(node, 1, 0.0, own, own.find(context))     # most frequent / total,
            assert got.score == pytest.approx(others.walk(want, 1, 0.0).score)   # whichever of a tie
            # a sampled walk's q: the others' continuation counts, normalised
            sampled, expected = everything.walk(node, 1, 0.0, own, own.find(context), [0.5]), \
                others.walk(want, 1, 0.0, uniforms=[0.5])
            as_dict = lambda walk: {t: pytest.approx(p) for t, p in zip(*walk.q[0])} if walk.q else {}
            assert as_dict(sampled) == as_dict(expected)


def test_running_sequences_draft_from_each_other():
    prompt, answer = [5, 6, 7], [1, 2, 3, 4, 1, 2, 8, 9]
    for index_running in (True, False):
        drafter = SuffixDrafter(SuffixParams(min_match=2, max_spec_factor=4.0, index_running=index_running))
        ahead, behind = seq_of(prompt, answer), seq_of(prompt, answer[:2])
        drafter.on_commit([ahead, behind])                   # both running; neither has finished
        # behind's own history has 1 2 -> nothing yet; ahead's text continues 1 2 with 3 4 and 8 9
        assert drafter.lookup(behind, 2).tokens == ([3, 4] if index_running else [])
        assert drafter._own[behind].draft(behind.all_ids(), 2, drafter.params) == ([], 0.0)
    drafter = SuffixDrafter(SuffixParams(min_match=2, max_spec_factor=4.0))
    alone = seq_of(prompt, answer)
    drafter.on_commit([alone])                               # its own text is not counted twice
    assert drafter.cache.trie.draft(alone.all_ids(), 4, drafter.params, drafter._own[alone]) == ([], 0.0)
    assert drafter.lookup(alone, 4).tokens == drafter._own[alone].draft(alone.all_ids()[-16:], 4, drafter.params)[0]


# ---- through the engine -----------------------------------------------------------------------------
def templated_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a template with a varying slot: the worker-wide index has something to find."""
    rng = random.Random(seed)
    head, tail = [rng.randrange(vocab) for _ in range(12)], [rng.randrange(vocab) for _ in range(6)]
    return [head + [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))] + tail for _ in range(n)]


@pytest.mark.parametrize("kind", ["suffix", "hybrid-suffix"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_identity_with_templated_prompts(target_model, draft_model, kind, batch_size):
    prompts = templated_prompts(10, target_model.config.vocab_size)
    prompts += prompts[:4]                                     # repeats: whole outputs are in the index
    max_new = 16
    params = SamplingParams(max_tokens=max_new, temperature=0)
    plain, _ = run_requests(make_engine(target_model, "none", max_num_seqs=batch_size), prompts, params)
    engine = make_engine(target_model, kind, draft_model, max_num_seqs=batch_size, g=4)
    done, rounds = run_requests(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_ids == plain[str(i)].output_ids
    for i in (0, 3, 11):
        assert done[str(i)].output_ids == greedy_reference(target_model, prompts[i], max_new)
    assert sum(r.accepted for r in rounds) > 0
    if kind == "suffix":           # a repeated prompt is drafted from the cache: most of it accepted
        for rid in ("10", "11", "12", "13"):
            assert sum(r.accepted for r in rounds if r.request_id == rid) >= max_new // 2


# ---- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("drafting.suffix.max_depth=1", "drafting.suffix.max_depth"),
    ("drafting.suffix.min_match=16", "drafting.suffix.min_match"),
    ("drafting.suffix.min_prob=1.5", "drafting.suffix.min_prob"),
    ("drafting.suffix.max_spec_factor=0", "drafting.suffix.max_spec_factor"),
    ("drafting.suffix.max_cached_tokens=-1", "drafting.suffix.max_cached_tokens"),
    ("drafting.suffix.depth=8", "drafting.suffix.depth"),
    ("drafting.suffix.sample_method=top", "drafting.suffix.sample_method"),
    ("drafting.hybrid_proposer=draft", "drafting.hybrid_proposer"),
])
def test_bad_suffix_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/demo.yaml", [override])


def test_suffix_config_loads_and_hashes():
    plain = load_config("configs/demo.yaml")
    assert "suffix" not in hashed_tree(plain)["drafting"] and "hybrid_proposer" not in hashed_tree(plain)["drafting"]
    cfg = load_config("configs/demo.yaml", ["drafting.method=suffix", "drafting.suffix.min_prob=0.2"])
    assert cfg.drafting.suffix == SuffixParams(min_prob=0.2)
    assert hashed_tree(cfg)["drafting"]["suffix"]["min_prob"] == 0.2
    other = load_config("configs/demo.yaml", ["drafting.method=suffix", "drafting.suffix.min_prob=0.3"])
    assert len({config_hash(plain), config_hash(cfg), config_hash(other)}) == 3
    hybrid = load_config("configs/demo.yaml", ["drafting.method=hybrid", "models.draft=x",
                                               "drafting.hybrid_proposer=suffix"])
    assert hashed_tree(hybrid)["drafting"]["hybrid_proposer"] == "suffix" and "suffix" in hashed_tree(hybrid)["drafting"]
    # the draft rule changes which tokens are proposed: another run
    greedy = load_config("configs/demo.yaml", ["drafting.method=suffix", "drafting.suffix.min_prob=0.2",
                                               "drafting.suffix.sample_method=greedy"])
    assert hashed_tree(greedy)["drafting"]["suffix"]["sample_method"] == "greedy"
    assert hashed_tree(cfg)["drafting"]["suffix"]["sample_method"] == "probabilistic"
    assert config_hash(greedy) != config_hash(cfg)


# ---- the job ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_worker_killed_mid_unit_with_suffix_drafter_completes_exactly_once(tiny_model_dir, ray_head, tmp_path):
    """The worker-wide index is in-memory state of the actor: a replacement starts with an empty one
    and the job still commits every row exactly once."""
    from pipeline.cluster.driver import run_job
    from pipeline_util import job_config, prompt_rows, read_run, write_parquet
    from pipeline_util import check_exactly_once
    rows = prompt_rows(10, "s", seed=3)
    rows += [dict(r, id=r["id"] + "-again") for r in rows]          # repeats: drafted from the index
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     f"cluster.address={ray_head.address}", "drafting.method=suffix", "drafting.suffix.min_match=1",
                     "debug.crash_worker_after_steps=3", "sampling.max_tokens=12", "cluster.num_workers=1")
    summary = run_job(cfg)
    assert summary["worker_restarts"] >= 1 and summary["unit_retries"] >= 1
    run = read_run(tmp_path / "out" / "t")
    check_exactly_once(run, [r["id"] for r in rows])
    assert not run["errors"] and summary["accepted_tokens"] > 0
