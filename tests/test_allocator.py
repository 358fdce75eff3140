"""The page allocator and the paged run's plan: pages are never handed out twice, freed pages
are reused, a prompt's shared pages are written once, ring pages wrap around the window, and an
exhausted pool is an error. The plan is replayed into a virtual pool of (page, row) -> token to
show that every sequence's table finds its own tokens. A draft mixing windowed and full layers
has a table per layer: its windowed layers' a ring repeated across the table's width (never more
than ``window / P + 1`` pages per sequence), its full layers' a growing list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_dflash.cli import allocator
from jax_dflash.cli.accept import parse_accept

# ---- the allocator ----------------------------------------------------------------------------


def test_no_page_is_handed_out_twice_and_exhaustion_is_an_error():
    pages = allocator.PageAllocator(5)
    got = [pages.alloc() for _ in range(5)]
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert pages.in_use == 5 and pages.free == 0
    with pytest.raises(allocator.PoolExhausted, match="all 5 pages are in use"):
        pages.alloc()


def test_freed_pages_are_reused_first():
    pages = allocator.PageAllocator(8)
    a, b, c = pages.alloc(), pages.alloc(), pages.alloc()
    pages.release(b)
    assert pages.alloc() == b  # the last freed page comes back first
    pages.release(a)
    pages.release(c)
    assert {pages.alloc(), pages.alloc()} == {a, c}
    assert pages.peak_in_use == 3


def test_shared_pages_are_freed_by_their_last_holder():
    pages = allocator.PageAllocator(2)
    p = pages.alloc()
    pages.share(p)
    pages.share(p)
    assert pages.refcount(p) == 3
    pages.release(p)
    pages.release(p)
    assert pages.free == 1 and pages.refcount(p) == 1
    pages.release(p)
    assert pages.free == 2
    with pytest.raises(ValueError, match="expected an allocated page id"):
        pages.release(p)
    with pytest.raises(ValueError, match="expected an allocated page id"):
        pages.share(7)
    with pytest.raises(ValueError, match="num_pages: expected an int > 0, got 0"):
        allocator.PageAllocator(0)


# ---- the plan ---------------------------------------------------------------------------------


def _plan(
    seed=0,
    *,
    steps=30,
    batch=4,
    block=8,
    page=8,
    max_length=64,
    window=None,
    accept="geometric:0.8",
    num_pages=None,
    window_layers=None,
):
    return allocator.plan_paged_run(
        np.random.default_rng(seed),
        parse_accept(accept, block),
        steps=steps,
        batch=batch,
        block_size=block,
        page_size=page,
        max_length=max_length,
        window=window,
        window_layers=window_layers,
        num_pages=num_pages,
    )


def _replay(plan, kind=0):
    """Writes every step's tokens into a virtual pool of one kind of layer (through the op's
    rule: the table's width ``M`` and the kind's ring); returns it and the write counts of each
    (page, row) in each phase (prefill, decode)."""
    P, N, M = plan.page_size, plan.num_pages, plan.table_pages
    ring, kind_pages = plan.kinds[kind].ring, plan.kinds[kind].num_pages
    pool: dict[tuple[int, int], tuple[int, int]] = {}
    writes = {"prefill": {}, "decode": {}}
    for phase, steps in (("prefill", plan.prefill), ("decode", plan.decode)):
        for i in range(steps.count):
            pos, own, streams, table = (
                steps.positions[i],
                steps.owners[i],
                steps.streams[i],
                plan.kind_tables(steps.tables[i])[kind],
            )
            targets = set()
            for t in np.flatnonzero(own >= 0):
                p, b = int(pos[t]), int(own[t])
                slot = (p // P) % M if ring else p // P
                assert slot < M, f"position {p} is past the table of {M} pages"
                kp, vp = int(table[b, 0, slot]), int(table[b, 1, slot])
                assert 0 <= kp < kind_pages and vp == kp + N, f"step {i}: token {t} has no page"
                target = (kp, p % P)
                assert target not in targets, f"step {i}: two tokens write {target}"
                targets.add(target)
                pool[target] = (int(streams[t]), p)
                writes[phase][target] = writes[phase].get(target, 0) + 1
            # Live rows never share a page the decode writes into.
            written_pages = {kp for kp, _ in targets}
            for b in range(plan.batch):
                row_pages = [int(x) for x in table[b, 0, : plan.kinds[kind].sequence_pages]]
                row_pages = [x for x in row_pages if x >= 0]
                assert len(row_pages) == len(set(row_pages))
            owners_of = {}
            for b in range(plan.batch):
                for x in table[b, 0]:
                    if x in written_pages:
                        owners_of.setdefault(int(x), set()).add(b)
            if phase == "decode":
                assert all(len(rows) == 1 for rows in owners_of.values()), (
                    f"step {i}: a page written in the decode is mapped by two rows"
                )
    return pool, writes


def _check_final_sequences(plan, pool, kind=0):
    P, M = plan.page_size, plan.table_pages
    table = plan.kind_tables(plan.decode.tables[-1])[kind]
    ring = plan.kinds[kind].ring
    assert plan.final, "no sequence in flight after the last step"
    for f in plan.final:
        for p in range(f.visible_starts[kind], f.length):
            slot = (p // P) % M if ring else p // P
            stream = f.prompt_id if p < f.prompt_length else f.stream
            assert pool[(int(table[f.row, 0, slot]), p % P)] == (stream, p), (
                f"row {f.row}: position {p} does not hold its own token"
            )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 5),
    accept=st.sampled_from(["uniform", "geometric:0.8", "fixed:8", "fixed:1"]),
    window=st.sampled_from([None, 8, 16, 24]),
)
def test_every_sequence_finds_its_own_tokens(seed, batch, accept, window):
    plan = _plan(seed, batch=batch, accept=accept, window=window)
    pool, writes = _replay(plan)
    _check_final_sequences(plan, pool)
    assert plan.peak_pages_in_use <= plan.num_pages


def test_sequences_finish_and_new_ones_reuse_their_pages():
    plan = _plan(1, steps=60, accept="fixed:8")
    assert plan.sequences_finished > 0 and plan.sequences_started > plan.batch
    pool, writes = _replay(plan)
    # A page written by two sequences in turn: freed by the first, handed to the second.
    rewritten = [t for t, n in writes["decode"].items() if n > 1]
    assert rewritten, "no freed page was reused"
    _check_final_sequences(plan, pool)


def test_shared_prompt_pages_are_written_once():
    plan = _plan(2, steps=60, batch=5, accept="uniform")
    pool, writes = _replay(plan)
    prompt_pages = {p for prompt in plan.prompts for p in prompt.pages}
    assert prompt_pages and plan.shared_page_references > len(plan.prompts)
    # Prefill writes each row of each prompt page once; the decode never writes them.
    assert {kp for kp, _ in writes["prefill"]} == prompt_pages
    assert all(n == 1 for n in writes["prefill"].values())
    assert len(writes["prefill"]) == len(prompt_pages) * plan.page_size
    assert not prompt_pages & {kp for kp, _ in writes["decode"]}
    # More sequences used the prompts than there are prompts: the pages were shared.
    assert plan.sequences_started > len(plan.prompts)


def test_ring_pages_wrap_around_the_window():
    window, page = 16, 8
    plan = _plan(3, steps=40, window=window, page=page, accept="fixed:8")
    assert plan.ring and plan.table_pages == window // page + 1
    assert plan.ring_page_reuses > 0
    long = [f for f in plan.final if f.length > plan.table_pages * page]
    assert long, "no sequence outgrew its ring"
    for f in long:  # the window (at least N tokens) is still held, older tokens are not
        assert f.length - f.visible_start >= window
        assert f.visible_start > 0
    pool, _ = _replay(plan)
    _check_final_sequences(plan, pool)


MIXED = (True, False, True)  # windowed, full, windowed


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 5),
    accept=st.sampled_from(["uniform", "geometric:0.8", "fixed:8", "fixed:1"]),
    window=st.sampled_from([8, 16, 24]),
)
def test_a_mixed_drafts_layers_each_find_their_own_tokens(seed, batch, accept, window):
    plan = _plan(seed, batch=batch, accept=accept, window=window, window_layers=MIXED)
    assert plan.mixed and plan.ring == MIXED
    assert [k.layers for k in plan.kinds] == [(0, 2), (1,)]
    for kind in range(2):
        pool, _ = _replay(plan, kind)
        _check_final_sequences(plan, pool, kind)
        assert plan.kinds[kind].peak_pages_in_use <= plan.kinds[kind].num_pages


def test_a_mixed_drafts_windowed_layers_hold_their_ring_and_full_layers_grow():
    window, page, max_length = 16, 8, 64
    ring_pages, full_pages = window // page + 1, max_length // page  # 3 and 8
    plan = _plan(3, steps=40, window=window, page=page, accept="fixed:8", window_layers=MIXED)
    M = plan.table_pages
    assert M % ring_pages == 0 and M >= full_pages and M == 9
    windowed, full = plan.kinds
    assert (windowed.sequence_pages, full.sequence_pages) == (ring_pages, full_pages)
    assert windowed.num_pages < full.num_pages == plan.num_pages
    assert windowed.ring_page_reuses > 0 and full.ring_page_reuses == 0
    for steps in (plan.prefill, plan.decode):
        assert steps.tables.shape[1:] == (3, plan.batch, 2, M)
        tables = steps.tables[:, :, :, 0]  # the K pages [n, layers, B, M]
        assert (
            steps.tables[:, :, :, 1] == np.where(tables >= 0, tables + plan.num_pages, -1)
        ).all()
        # The windowed layers share one table: a ring of at most M_w pages, repeated.
        assert (tables[:, 0] == tables[:, 2]).all()
        ring = tables[:, 0]
        assert (ring == ring[..., np.arange(M) % ring_pages]).all()
        for row in ring.reshape(-1, M):
            held = row[:ring_pages][row[:ring_pages] >= 0]
            assert len(set(held.tolist())) == len(held) <= ring_pages
            assert set(row[row >= 0].tolist()) == set(held.tolist())
            assert (held < windowed.num_pages).all()
        # The full layer's list: up to its longest sequence's pages, none past them.
        assert (tables[:, 1, :, full_pages:] == -1).all()
    assert windowed.most_pages_per_sequence == ring_pages
    assert full.most_pages_per_sequence > ring_pages
    grown = [f for f in plan.final if f.length > ring_pages * page]
    assert grown, "no sequence outgrew its window"
    for f in grown:  # the window is still held by the windowed layers, all of it by the full
        assert f.visible_starts[1] == 0 and f.visible_starts[0] > 0
        assert f.length - f.visible_starts[0] >= window


def test_window_layers_need_a_mix_and_a_window():
    for window, layers in ((None, MIXED), (16, (True, True)), (16, (False, False))):
        with pytest.raises(ValueError, match="window_layers: expected a mix of windowed and"):
            _plan(0, window=window, window_layers=layers)


def test_a_pool_too_small_for_the_batch_is_an_error():
    with pytest.raises(allocator.PoolExhausted, match="page pool exhausted"):
        _plan(4, steps=30, batch=4, accept="fixed:8", num_pages=12)
