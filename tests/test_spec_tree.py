"""Tree builders and acceptance against brute-force references (no models)."""

import itertools
import math

import pytest
import torch

from spec_engine import BestFirstTree, ChainTree, IndependentTree, NgramDrafter
from spec_engine.tree import DraftRequest, NodeLattice, PositionLattice, TreeBatch
from spec_engine.verify import VerifyOutput, accept


def _random_lattice(g, m: int, vocab: int = 50) -> NodeLattice:
    parents, logp = [], []
    for i in range(m):
        parents.append(int(torch.randint(-1, i, (1,), generator=g)) if i else -1)
        logp.append(-float(torch.rand(1, generator=g)) * 3 - 1e-3)
    tokens = torch.randint(0, vocab, (m,), generator=g).tolist()
    return NodeLattice.from_lists(tokens, parents, logp)


def _paths(tb: TreeBatch, b: int = 0):
    """Set of root-to-node token paths of the valid nodes."""
    toks, pars, valid = tb.tokens[b].tolist(), tb.parents[b].tolist(), tb.valid[b].tolist()
    out = set()
    for i in range(len(toks)):
        if not valid[i]:
            continue
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = pars[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("m,n", [(1, 1), (5, 3), (40, 16), (40, 64), (200, 64)])
def test_best_first_selects_top_scores_prefix_closed(rng, m, n):
    lat = _random_lattice(rng, m)
    tb = BestFirstTree(n).build([lat])
    tb.validate()
    k = min(n, m)
    assert tb.nodes == n and int(tb.valid.sum()) == k
    want = sorted(lat.scores.tolist(), reverse=True)[:k]
    got = sorted(tb.scores[0][tb.valid[0]].tolist(), reverse=True)
    assert got == pytest.approx(want)


def test_best_first_ties_stay_prefix_closed():
    # log-prob 0 edges make children tie with their parents: the stable order must still keep parents.
    lat = NodeLattice.from_lists([5, 6, 7, 8, 9], [-1, 0, 1, -1, 3], [0.0, 0.0, 0.0, 0.0, 0.0])
    for n in range(1, 6):
        BestFirstTree(n).build([lat]).validate()


@pytest.mark.parametrize("P,K,n", [(1, 3, 2), (3, 3, 5), (4, 4, 20), (5, 3, 64)])
@pytest.mark.parametrize("cond", [False, True])
def test_position_heap_matches_enumeration(rng, P, K, n, cond):
    tokens = torch.stack([torch.randperm(30, generator=rng)[:K] for _ in range(P)])
    logp = -torch.rand(P, K, generator=rng) * 4
    cl = -torch.rand(P, K, K, generator=rng) * 4 if cond else None
    lat = PositionLattice(tokens, logp, cl)
    builder = BestFirstTree(n, max_depth=P) if cond else IndependentTree(n, max_depth=P)
    tb = builder.build([lat])
    tb.validate()
    scores = []  # every prefix path with its score
    for d in range(1, P + 1):
        for combo in itertools.product(range(K), repeat=d):
            s = float(logp[0, combo[0]])
            for p in range(1, d):
                s += float(cl[p, combo[p - 1], combo[p]]) if cond else float(logp[p, combo[p]])
            scores.append(s)
    want = sorted(scores, reverse=True)[: min(n, len(scores))]
    got = sorted(tb.scores[0][tb.valid[0]].tolist(), reverse=True)
    assert got == pytest.approx(want, abs=1e-5)


def test_chain_follows_best_child():
    # Root children 10 (-0.1) and 11 (-2); under 10: 12 (-0.5) and 13 (-0.2); under 13: 14.
    lat = NodeLattice.from_lists([10, 11, 12, 13, 14], [-1, -1, 0, 0, 3], [-0.1, -2.0, -0.5, -0.2, -0.3])
    tb = ChainTree(5).build([lat])
    tb.validate()
    assert tb.tokens[0, :3].tolist() == [10, 13, 14] and tb.valid[0].tolist() == [True] * 3 + [False] * 2
    assert _paths(tb) == {(10,), (10, 13), (10, 13, 14)}


def _brute_longest(tb: TreeBatch, argmax: list[int]) -> int:
    """Length of the longest root path whose tokens equal the argmax after their parent (DFS)."""
    toks, pars, valid = tb.tokens[0].tolist(), tb.parents[0].tolist(), tb.valid[0].tolist()

    def longest(cur):
        kids = [i for i in range(len(toks)) if valid[i] and pars[i] == cur and toks[i] == argmax[cur + 1]]
        return max((1 + longest(i) for i in kids), default=0)

    return longest(-1)


@pytest.mark.parametrize("n", [0, 1, 4, 16, 64])
def test_accept_matches_brute_force(rng, n):
    for _ in range(30):
        lat = _random_lattice(rng, max(n, 1) * 2, vocab=4)  # tiny vocab: many matches, duplicate siblings
        tb = BestFirstTree(max(n, 1)).build([lat])
        if n == 0:
            tb = tb.trimmed(0)
        argmax = torch.randint(0, 4, (1, tb.nodes + 1), generator=rng)
        am = argmax[0].tolist()
        acc = accept(tb, VerifyOutput(argmax=argmax, base=0))[0]
        assert len(acc.tokens) == _brute_longest(tb, am) + 1
        assert acc.rows[0] == 0 and len(acc.rows) == len(acc.tokens)
        for prev, row, tok in zip(acc.rows, acc.rows[1:], acc.tokens):  # a real path of matching nodes
            assert int(tb.parents[0, row - 1]) + 1 == prev and int(tb.tokens[0, row - 1]) == tok == am[prev]
            assert bool(tb.valid[0, row - 1])
        assert acc.tokens[-1] == am[acc.rows[-1]]  # the bonus comes from the last accepted row


def test_ngram_lattice_trie():
    d = NgramDrafter(max_ngram=2, max_matches=8)
    d.reset(torch.tensor([1, 2, 3, 1, 2, 4, 1, 2]))
    lat = d.propose(DraftRequest(depth=2, beam=1, topk=1))
    tb = BestFirstTree(8).build([lat])
    tb.validate()
    assert _paths(tb) >= {(4,), (4, 1), (3,), (3, 1)}
    # two continuations after "1 2": the first edges split the mass evenly
    assert sorted(math.exp(x) for x in lat.logp[lat.parents == -1].tolist())[-1] == pytest.approx(0.5)
    empty = NgramDrafter()
    empty.reset(torch.tensor([7]))
    assert empty.propose(DraftRequest(depth=3, beam=1, topk=1)).size == 0


def test_tree_argument_errors():
    with pytest.raises(ValueError, match="length"):
        ChainTree(0)
    with pytest.raises(ValueError, match="nodes"):
        BestFirstTree(0)
    with pytest.raises(ValueError, match="max_depth"):
        BestFirstTree(4, max_depth=0)
    with pytest.raises(ValueError, match="cond_logp"):
        PositionLattice(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="must both be"):
        PositionLattice(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="parents"):
        NodeLattice.from_lists([1, 2], [-1, 1], [-0.1, -0.1])
    with pytest.raises(ValueError, match="DraftRequest"):
        DraftRequest(depth=0, beam=1, topk=1)
    bad = TreeBatch(
        torch.tensor([[1, 2]]),
        torch.tensor([[-1, 0]]),
        torch.tensor([[1, 3]]),
        torch.zeros(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="depth"):
        bad.validate()
