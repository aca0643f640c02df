"""The pool against a model of its rules, checked after every step of thousands of random steps.

``PoolModel`` is the pool's contract written as plainly as possible (docs/architecture.md, "Pool state"):
which adapters are resident and in which LRU order, the host tier and its order, pins, and which batches
are live and current. Each step applies one random operation to both (sync loads, awaited async loads,
tensors given directly, unloads, pins, new batches, batches rebuilt in place, refreshed, released,
dropped and garbage collected, forwards of kept batches) and compares everything the pool exposes:
its state, every batch's currency, each refusal's type and message, and each forward's output against the
fp32 oracle of the adapters the batch names. The pool's own invariants are checked after every
transaction (the suite's debug mode).
"""

from __future__ import annotations

import gc
import random
import types
from collections import OrderedDict
from functools import partial

import pytest
import torch
from test_pool import LAYERS, make_adapter, make_base, make_pool, make_routing

from moelora import AdapterLoadError, FusedMoEWithLoRA, StaleBatchError
from moelora.reference import reference_moe

LAYER = LAYERS[0]
NAMES = ("a", "b", "c", "d", "e")
# fp32 against the fp32 oracle in another summation order; adapters of scaling up to 2 make outputs of
# order 1-10, so the bound is relative. An adapter mixed up with another is off by order 1.
TOL = dict(atol=1e-5, rtol=1e-4)


class PoolModel:
    """The pool's rules on plain Python containers. ``weights`` names the tensors each adapter holds."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.resident: OrderedDict[str, tuple] = OrderedDict()  # name -> (epoch, weights, source)
        self.host: OrderedDict[str, tuple] = OrderedDict()  # name -> (weights, source)
        self.pinned: set[str] = set()
        self.batches: dict[int, dict] = {}  # id -> {"names", "lens", "epochs", "live"}
        self.epoch = 0
        self.evictions = 0  # by LRU (explicit unloads not counted)

    # -- what the pool derives -------------------------------------------------------------------------
    def users(self, name: str) -> int:
        epoch = self.resident[name][0]
        return sum(1 for b in self.batches.values() if b["live"] and b["epochs"].get(name) == epoch)

    def current(self, bid: int) -> bool:
        epochs = self.batches[bid]["epochs"].items()
        return all(n in self.resident and self.resident[n][0] == e for n, e in epochs)

    # -- transitions -----------------------------------------------------------------------------------
    def _victim(self, protected: set[str]) -> str | None:
        for n in self.resident:
            if n not in self.pinned and self.users(n) == 0 and n not in protected:
                return n
        return None

    def evict(self, name: str) -> None:
        _, weights, source = self.resident.pop(name)
        self.pinned.discard(name)
        if self.max_cpu_loras:
            self.host[name] = (weights, source)
            self.host.move_to_end(name)
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)

    def place(self, name: str, weights: str, source: str | None, protected: set[str] = frozenset()) -> None:
        if name in self.resident:
            raise AdapterLoadError("already loaded")
        if len(self.resident) == self.max_loras:
            victim = self._victim(set(protected))
            if victim is None:
                raise AdapterLoadError("pinned or used by live batches")
            self.evict(victim)
            self.evictions += 1
        self.epoch += 1
        self.resident[name] = (self.epoch, weights, source)
        self.host.pop(name, None)

    def load(self, name: str, weights: str, source: str) -> None:
        cached = self.host.get(name)
        if cached is not None and cached[1] == source:
            self.host.move_to_end(name)
            weights = cached[0]
        self.place(name, weights, source)

    def unload(self, name: str) -> None:
        if name not in self.resident:
            if name in self.host:
                del self.host[name]
                return
            raise ValueError("is not loaded")
        if name in self.pinned:
            raise ValueError("is pinned")
        self.evict(name)

    def pin(self, name: str) -> None:
        if name not in self.resident:
            raise ValueError("is not loaded")
        self.pinned.add(name)

    def prepare(self, bid: int, names: tuple, lens: tuple) -> None:
        unknown = {n for n in names if n is not None and n not in self.resident and n not in self.host}
        if unknown:
            raise ValueError("unknown adapter")
        wanted = list(dict.fromkeys(n for n, k in zip(names, lens, strict=True) if n is not None and k > 0))
        missing = [(n, *self.host[n]) for n in wanted if n not in self.resident]
        protected = {n for n in wanted if n in self.resident}
        for n, weights, source in missing:
            self.place(n, weights, source, protected)
            protected.add(n)
        for n in wanted:
            self.resident.move_to_end(n)
        self.batches[bid] = {"names": names, "lens": lens, "live": True,
                             "epochs": {n: self.resident[n][0] for n in wanted}}


def _expect(model_call, pool_call):
    """Runs the model's step, then the pool's; both must succeed, or both refuse with the same type (the
    pool's message containing the model's words). Returns the pool's result."""
    try:
        model_call()
    except (ValueError, AdapterLoadError) as want:
        with pytest.raises(type(want), match=str(want)):
            pool_call()
        return None
    return pool_call()


def _random_lens(rng: random.Random, count: int, total: int | None = None) -> tuple[int, ...]:
    if total is None:
        return tuple(rng.choice((0, 1, 1, 2, 3)) for _ in range(count))
    cuts = sorted(rng.randint(0, total) for _ in range(count - 1))
    return tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))


@pytest.mark.parametrize(("seed", "max_cpu_loras"), [(1, 0), (2, 2), (3, 4)])
def test_pool_follows_its_model(seed, max_cpu_loras, tmp_path, monkeypatch):
    import moelora.stager as stager_module

    rng = random.Random(seed)
    torch.manual_seed(seed)
    x, w13, w2 = make_base(6)
    # Two versions of each adapter on disk: a load from the other directory must not get the host copy.
    tensors = {(n, v): make_adapter(rng.choice((2, 4, 8, 16)), rng.choice((0.5, 1.0, 2.0)))
               for n in NAMES for v in (1, 2)}
    for n in NAMES:
        for v in (1, 2):
            (tmp_path / f"v{v}" / n).mkdir(parents=True)
    reads = []

    def fake_read(path, **kw):
        name, version = path.name, int(path.parent.name[1:])
        reads.append((name, version))
        return {LAYER: tensors[(name, version)]}, types.SimpleNamespace(path=str(path), dtype="float32")

    monkeypatch.setattr(stager_module, "read_peft_adapter", fake_read)
    pool = make_pool(max_loras=3)
    pool.max_cpu_loras = max_cpu_loras
    model = PoolModel(3, max_cpu_loras)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER, path="torch")
    batches: dict[int, object] = {}
    counts = dict.fromkeys(("forwards", "stale_refused", "refused", "refreshed", "gc"), 0)
    next_id = 0

    def weights_of(name):
        return model.resident[name][1]

    for _ in range(1500):
        op = rng.random()
        name = rng.choice(NAMES)
        version = rng.choice((1, 2))
        path = tmp_path / f"v{version}" / name
        if op < 0.12:
            _expect(partial(model.load, name, (name, version), str(path.resolve())),
                    partial(pool.load_adapter, name, path))
        elif op < 0.20:
            _expect(partial(model.load, name, (name, version), str(path.resolve())),
                    lambda: pool.load_adapter_async(name, path).result(timeout=30))  # noqa: B023 - run at once
        elif op < 0.25:
            _expect(partial(model.place, name, (name, version), None),
                    partial(pool.add_adapter_weights, name, {LAYER: tensors[(name, version)]}))
        elif op < 0.35:
            _expect(partial(model.unload, name), partial(pool.unload_adapter, name))
        elif op < 0.40:
            _expect(partial(model.pin, name), partial(pool.pin, name))
        elif op < 0.45:
            model.pinned.discard(name)
            pool.unpin(name)
        elif op < 0.62 or not batches:
            count = rng.randint(1, 4)
            names = tuple(rng.choice((*NAMES, None, None)) for _ in range(count))
            lens = _random_lens(rng, count)
            bid = next_id
            next_id += 1
            made = _expect(partial(model.prepare, bid, names, lens), partial(pool.prepare_batch, names, lens))
            if made is not None:
                batches[bid] = made
            else:
                counts["refused"] += 1
            made = None  # the kept list is the only reference: a dropped batch is collected
        else:
            bid = rng.choice(list(batches))
            batch = batches[bid]
            sub = rng.random()
            if sub < 0.25:  # rebuilt in place with other names, same token count
                count = rng.randint(1, 4)
                names = tuple(rng.choice((*NAMES, None)) for _ in range(count))
                lens = _random_lens(rng, count, batch.num_tokens)
                if rng.random() < 0.3:
                    names, lens = batch.adapter_names, batch.seq_lens
                before = dict(model.batches[bid])

                def model_rebuild(bid=bid, names=names, lens=lens, before=before):
                    try:
                        model.prepare(bid, names, lens)
                    except (ValueError, AdapterLoadError):
                        model.batches[bid] = before  # a refused rebuild leaves the batch as it was
                        raise

                _expect(model_rebuild, partial(pool.prepare_batch, names, lens, out=batch))
            elif sub < 0.40:
                model.batches[bid]["live"] = False
                batch.release()
            elif sub < 0.50:
                model.batches[bid]["live"] = False
                del batches[bid]
                batch = None
                gc.collect()
                counts["gc"] += 1
                continue
            elif sub < 0.60:
                m = model.batches[bid]
                if model.current(bid):
                    assert pool.refresh(batch) is False
                else:
                    _expect(partial(model.prepare, bid, m["names"], m["lens"]), partial(pool.refresh, batch))
                    counts["refreshed"] += 1
            else:  # a forward of a kept batch: exact when current, refused as stale otherwise
                m = model.batches[bid]
                tokens = batch.num_tokens
                if not tokens:
                    continue
                xs = torch.randn(tokens, x.shape[1])
                weights, ids = make_routing(tokens, top_k=rng.choice((1, 2, 6)))
                if model.current(bid):
                    out = layer(xs, weights, ids, batch)
                    per_token = [n for n, k in zip(m["names"], m["lens"], strict=True) for _ in range(k)]
                    order = sorted({n for n in per_token if n is not None})
                    loras = [tensors[weights_of(n)] for n in order]
                    per_token = [-1 if n is None else order.index(n) for n in per_token]
                    want = reference_moe(xs, w13, w2, weights, ids, adapters=loras, token_adapter=per_token)
                    torch.testing.assert_close(out, want, **TOL)
                    counts["forwards"] += 1
                else:
                    with pytest.raises(StaleBatchError, match="stale batch"):
                        layer(xs, weights, ids, batch)
                    counts["stale_refused"] += 1

        # Everything the pool exposes agrees with the model, after every step.
        state = pool.state()
        assert state.resident == tuple(model.resident), (state, model.resident)
        assert state.host == tuple(model.host), (state.host, model.host)
        assert state.pinned == model.pinned and state.loading == () and state.evictions == model.evictions
        assert state.users == {n: model.users(n) for n in model.resident}, (state.users, model.batches)
        for bid, batch in batches.items():
            assert pool.is_current(batch) == model.current(bid), bid
        assert sorted(pool.adapters()) == sorted(model.resident)

    pool.check_invariants()
    assert all(v >= 15 for v in counts.values()), counts
    pool.close()
