"""Offline data (moelab.models.data) and synthetic routing traces (moelab.models.traces)."""
import numpy as np
import pytest
import torch

from moelab.config import RunConfig
from moelab.models.data import ByteCorpus, get_corpus, stdlib_text
from moelab.models.tasks import make_batch
from moelab.models.traces import KINDS, routing_trace, trace_to_token_choices

torch.set_num_threads(1)


# ---- byte corpus --------------------------------------------------------------------------------

def test_stdlib_text_is_real_and_cached():
    data = stdlib_text()
    assert len(data) == 4 << 20
    assert stdlib_text() is data  # lru_cache: one copy per process
    for word in (b"def ", b"import ", b"return", b"class "):
        assert data.count(word) > 100
    printable = sum(data.count(bytes([c])) for c in range(32, 127)) + data.count(b"\n")
    assert printable / len(data) > 0.9
    small = stdlib_text(1 << 17)
    assert len(small) == 1 << 17 and data.startswith(small)


def test_gpt_batch_shapes_and_shift():
    c = ByteCorpus("gpt")
    b = c.batch(rank=1, world=2, iteration=3, batch_size=4, seq_len=24, seed=0)
    assert b["inputs"].shape == b["targets"].shape == (4, 24)
    assert b["inputs"].dtype == b["targets"].dtype == torch.int64
    assert torch.equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    assert b["sample_ids"].tolist() == [28, 29, 30, 31]  # (iteration*world + rank)*B + b
    # windows are real substrings of the corpus
    data = stdlib_text()
    for row in torch.cat([b["inputs"], b["targets"][:, -1:]], 1):
        assert bytes(row.tolist()) in data


def test_corpus_deterministic():
    a = ByteCorpus("gpt").batch(0, 2, 5, 4, 32, seed=3)
    b = ByteCorpus("gpt").batch(0, 2, 5, 4, 32, seed=3)
    c = ByteCorpus("gpt").batch(0, 2, 5, 4, 32, seed=4)
    assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["targets"], b["targets"])
    assert not torch.equal(a["inputs"], c["inputs"])
    assert get_corpus("gpt", 256, "pydocs") is get_corpus("gpt", 256, "pydocs")


def test_ranks_and_iterations_disjoint():
    c = ByteCorpus("gpt")
    S, world = 32, 4
    seen = set()
    for it in range(20):
        for r in range(world):
            b = c.batch(r, world, it, 8, S, seed=0)
            for row in b["inputs"]:
                seen.add(bytes(row.tolist()))
            ids = c._window_index(b["sample_ids"].numpy(), S + 1, 0)
            assert len(set(ids.tolist())) == 8
    # 640 windows, all different; aligned non-overlapping windows make this a guarantee, not luck
    assert len(seen) == 20 * world * 8
    all_ids = c._window_index(np.arange(640), S + 1, 0)
    assert len(np.unique(all_ids)) == 640


def test_global_batch_independent_of_world():
    """world=1, B=8 reads the same sequences as world=2, B=4 (needed for EP=1 vs EP=N tests)."""
    for arch in ("gpt", "bert"):
        c = ByteCorpus(arch)
        one = c.batch(0, 1, 2, 8, 16, seed=1)
        two = [c.batch(r, 2, 2, 4, 16, seed=1) for r in range(2)]
        for k in ("inputs", "targets", "sample_ids"):
            assert torch.equal(one[k], torch.cat([t[k] for t in two]))


def test_bert_masking_rates():
    c = ByteCorpus("bert")
    assert c.mask_id == 255
    B, S = 64, 128
    b = c.batch(0, 1, 0, B, S, seed=0)
    orig = torch.from_numpy(c.sequences(b["sample_ids"].numpy(), S + 1, 0)[:, :-1])
    inputs, targets = b["inputs"], b["targets"]
    sel = targets != -100
    n = sel.sum().item()
    assert abs(n / (B * S) - 0.15) < 0.015
    assert torch.equal(targets[sel], orig[sel])
    assert torch.equal(inputs[~sel], orig[~sel])  # unselected positions untouched
    assert not (inputs[~sel] == c.mask_id).any()  # the mask token is reserved
    masked = (inputs[sel] == c.mask_id).float().mean().item()
    kept = (inputs[sel] == orig[sel]).float().mean().item()
    swapped = 1 - masked - kept
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.03 and abs(swapped - 0.1) < 0.03
    assert int(inputs.max()) <= 255 and int(inputs.min()) >= 0


def test_random_dataset_and_small_vocab():
    c = ByteCorpus("gpt", vocab_size=50, dataset="random")
    a, b = c.batch(0, 2, 0, 3, 40, seed=0), c.batch(1, 2, 0, 3, 40, seed=0)
    assert int(a["inputs"].max()) < 50 and int(a["inputs"].min()) >= 0
    assert not torch.equal(a["inputs"], b["inputs"])
    assert torch.equal(a["inputs"], c.batch(0, 2, 0, 3, 40, seed=0)["inputs"])
    counts = torch.bincount(torch.cat([c.batch(0, 1, i, 8, 64)["inputs"].flatten() for i in range(10)]), minlength=50)
    assert counts.min() > 60  # uniform: ~102 each
    folded = ByteCorpus("gpt", vocab_size=100)
    assert int(folded.batch(0, 1, 0, 8, 64)["inputs"].max()) < 100
    with pytest.raises(ValueError):
        ByteCorpus("gpt", dataset="wikitext")
    with pytest.raises(ValueError):
        ByteCorpus("gpt").batch(2, 2, 0, 1, 8)


def test_make_batch_from_runconfig():
    cfg = RunConfig().with_overrides({"train.batch_size": 3, "model.seq_len": 20, "train.seed": 7})
    b = make_batch(cfg, rank=1, world=2, iteration=4)
    assert b["inputs"].shape == (3, 20)
    assert torch.equal(b["inputs"], ByteCorpus("gpt").batch(1, 2, 4, 3, 20, seed=7)["inputs"])
    bert = cfg.with_overrides({"model.arch": "bert", "train.dataset": "random"})
    bb = make_batch(bert, 0, 2, 0)
    assert (bb["targets"] != -100).any() and (bb["inputs"] == 255).any()


# ---- routing traces -------------------------------------------------------------------------------

ARGS = dict(iters=6, layers=2, world=4, num_experts=8, tokens_per_rank=50, top_k=2)


@pytest.mark.parametrize("kind", KINDS)
def test_trace_row_sums_caps_and_determinism(kind):
    C = routing_trace(kind, seed=1, **ARGS)
    assert C.shape == (6, 2, 4, 8) and C.dtype == torch.int64
    assert (C >= 0).all() and (C <= 50).all()
    sums = C.sum(-1)
    if kind == "zero_rank":
        assert (sums[:, :, 0] == 0).all() and (sums[:, :, 1:] == 100).all()
    else:
        assert (sums == 100).all()
    assert torch.equal(C, routing_trace(kind, seed=1, **ARGS))
    # every row can be realised as concrete per-token choices
    for row in C.reshape(-1, 8)[:10]:
        ch = trace_to_token_choices(row, 2, seed=0)
        assert torch.equal(torch.bincount(ch.flatten(), minlength=8), row)


def test_balanced_trace():
    C = routing_trace("balanced", iters=3, layers=1, world=2, num_experts=6, tokens_per_rank=10, top_k=2)
    assert (C.max(-1).values - C.min(-1).values <= 1).all()  # 20 over 6 experts: 3 or 4 each


def test_hot_expert_trace():
    C = routing_trace("hot_expert", expert=3, share=0.4, **ARGS)
    assert (C[..., 3] == 40).all()  # 40% of 100 assignments = 80% of the 50 tokens
    others = torch.cat([C[..., :3], C[..., 4:]], -1)
    assert (others.max(-1).values < 40).all()
    every = routing_trace("hot_expert", expert=0, share=0.5, **ARGS)  # share 1/k: every token picks it
    assert (every[..., 0] == 50).all()
    with pytest.raises(ValueError):
        routing_trace("hot_expert", expert=0, share=0.6, **ARGS)  # > 1/k is impossible


def test_hot_rank_trace():
    C = routing_trace("hot_rank", rank=2, share=0.6, **ARGS)  # rank 2 owns experts 4, 5 under EP
    assert (C[..., 4:6].sum(-1) == 60).all()
    assert (C[..., 4:6].min(-1).values > torch.cat([C[..., :4], C[..., 6:]], -1).max(-1).values).all()
    with pytest.raises(ValueError):
        routing_trace("hot_rank", rank=0, share=0.3, **{**ARGS, "num_experts": 6})  # 6 % 4 != 0


def test_zero_rank_trace_with_base():
    C = routing_trace("zero_rank", rank=3, base="hot_expert", base_params={"expert": 1, "share": 0.5}, **ARGS)
    assert (C[:, :, 3] == 0).all()
    assert (C[:, :, :3, 1] == 50).all()
    with pytest.raises(TypeError):
        routing_trace("zero_rank", rank=1, bogus=1, **ARGS)


def test_zipf_drift_trace():
    E = 32
    C = routing_trace("zipf_drift", iters=400, layers=1, world=4, num_experts=E, tokens_per_rank=256,
                      top_k=2, seed=0, s=1.2, drift=0.1)
    load = C[:, 0].sum(1).double()  # [iter, expert], summed over sources
    share = load / load.sum(-1, keepdim=True)
    # Zipf shape: the hottest expert holds about p1 = 1/H(E, s) of the assignments
    p1 = 1 / sum(1 / i ** 1.2 for i in range(1, E + 1))
    assert abs(share.max(-1).values.mean().item() - p1) < 0.03
    # imbalance: the top 4 experts hold far more than 4/32
    assert share.sort(-1, descending=True).values[:, :4].sum(-1).mean() > 0.5

    def ranking(sh, t):  # ranks from a 5-iteration window, to average out sampling noise
        return sh[t:t + 5].mean(0).argsort(descending=True).argsort().double()

    def spearman(a, b):
        return torch.corrcoef(torch.stack([a, b]))[0, 1].item()

    assert spearman(ranking(share, 0), ranking(share, 5)) > 0.9  # slow: nearby iterations look alike
    assert spearman(ranking(share, 0), ranking(share, 395)) < 0.5  # but the ranking drifts away
    top4 = lambda t: set(share[t:t + 5].mean(0).topk(4).indices.tolist())
    assert top4(0) != top4(395)
    still = routing_trace("zipf_drift", iters=400, layers=1, world=4, num_experts=E, tokens_per_rank=256,
                          seed=0, drift=0.0)
    ss = still[:, 0].sum(1).double()
    assert spearman(ranking(ss, 0), ranking(ss, 395)) > 0.9  # no drift: the ranking stays


def test_trace_to_token_choices():
    row = torch.tensor([5, 0, 3, 2])  # T=5 tokens, k=2
    ch = trace_to_token_choices(row, top_k=2, seed=1)
    assert ch.shape == (5, 2) and ch.dtype == torch.int64
    assert (ch[:, 0] != ch[:, 1]).all()  # distinct experts per token
    assert torch.equal(torch.bincount(ch.flatten(), minlength=4), row)
    assert torch.equal(ch, trace_to_token_choices(row, 2, seed=1))
    assert (ch[:, 0] == 0).any() and (ch[:, 1] == 0).any()  # within-token order shuffled
    # top-1 and a zero row
    assert torch.equal(torch.bincount(trace_to_token_choices([2, 1, 0], 1).flatten(), minlength=3),
                       torch.tensor([2, 1, 0]))
    assert trace_to_token_choices([0, 0, 0], 2).shape == (0, 2)
    with pytest.raises(ValueError):
        trace_to_token_choices([6, 0, 4], 2)  # expert 0 would need to appear twice in a token
    with pytest.raises(ValueError):
        trace_to_token_choices([3, 0, 0], 2)  # sum not a multiple of k


def test_text_domains_are_different_corpora():
    """``pytests`` is the stdlib's test suite, ``pytext`` its .txt/.html files: each batch is a substring of
    its own domain's text, and the domains' byte statistics differ (what Lina's Table 6 substitute needs)."""
    import numpy as np

    from moelab.models.data import TEXT_DOMAINS

    hist = {}
    for d in TEXT_DOMAINS:
        text = stdlib_text(domain=d)
        assert len(text) >= 1 << 16
        b = ByteCorpus("gpt", dataset=d).batch(0, 1, 0, 4, 32, seed=0)
        for row in torch.cat([b["inputs"], b["targets"][:, -1:]], 1):
            assert bytes(row.tolist()) in text
        h = np.bincount(np.frombuffer(text, dtype=np.uint8), minlength=256).astype(float)
        hist[d] = h / h.sum()
    assert stdlib_text(domain="pytests") != stdlib_text(domain="pydocs")
    assert b"def test" in stdlib_text(domain="pytests")[:1 << 20]
    assert b"<html" in stdlib_text(domain="pytext").lower() or b"<!doctype" in stdlib_text(domain="pytext").lower()
    tv = lambda a, c: 0.5 * np.abs(hist[a] - hist[c]).sum()  # noqa: E731
    assert tv("pytext", "pydocs") > 0.05 and tv("pytests", "pydocs") > 0.01
