"""The paged KV pool's page allocator and the host-side plan of a paged run.

:class:`PageAllocator` hands out page ids with reference counts: a page is free, owned by one
sequence, or shared (a prompt's full pages, held by the prompt cache and by every sequence
started from that prompt). :func:`plan_paged_run` simulates the engine's scheduler up front, so
the device never waits for the host: prompts are prefilled once into shared pages; sequences
start from a random prompt, grow by the accepted tokens of each step (a new page when a
position starts one), finish at their length (their pages are released and reused by the
sequences that start next), and with a sliding window (``ring``) keep ``window / P + 1`` pages:
position ``p`` lives in page slot ``(p // P) % M``, so a page is overwritten only once all of
its tokens have left the window. Every row of a page is written once while one owner holds it.

A draft that mixes sliding-window and full layers has a kind of pages per kind of layer
(:class:`PageKind`), each with its own allocator (each layer has its own pool): the windowed
layers' rings of ``M_w = window / P + 1`` pages per sequence and the full layers' growing
lists. The op takes one table width ``M`` for every layer, so ``M`` is the full layers' pages
rounded up to a multiple of ``M_w`` and a windowed layer's table repeats its ring (row ``j``
holds ring page ``j % M_w``): the op's ring index ``(p // P) % M`` then finds ring page
``(p // P) % M_w``. Windowed layers' tables never hold more than ``M_w`` distinct pages.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class PoolExhausted(RuntimeError):
    """No free page left: the pool is too small for the sequences in flight."""


class PageAllocator:
    """Reference-counted page ids in ``[0, num_pages)``; freed pages are handed out again
    first (last freed, first reused), as engines do to keep the working set small."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages: expected an int > 0, got {num_pages}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, np.int64)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.peak_in_use = 0

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhausted(
                f"page pool exhausted: all {self.num_pages} pages are in use (expected a free "
                f"page for a new page of a sequence; the pool is too small for this batch)"
            )
        page = self._free.pop()
        self._refs[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return page

    def share(self, page: int) -> int:
        """One more holder of an allocated page."""
        self._check_held(page)
        self._refs[page] += 1
        return page

    def release(self, page: int) -> None:
        """One holder less; the page is free again when none is left."""
        self._check_held(page)
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def _check_held(self, page: int) -> None:
        if not 0 <= page < self.num_pages or self._refs[page] == 0:
            raise ValueError(
                f"page: expected an allocated page id in [0, {self.num_pages}), "
                f"got {page} (refcount {self._refs[page] if 0 <= page < self.num_pages else 'n/a'})"
            )


# ---- the plan of a paged run ----------------------------------------------------------------


@dataclasses.dataclass
class Prompt:
    id: int  # also its feature stream
    length: int
    pages_by_kind: list[list[int]]  # its full pages, shared, in each kind's pool

    @property
    def pages(self) -> list[int]:
        """Its pages in the first kind's pool (the only one unless the draft mixes kinds)."""
        return self.pages_by_kind[0]


@dataclasses.dataclass
class PageKind:
    """The pages of one kind of layer: a sliding window's ring (reused in place once its tokens
    left the window) or a full layer's growing list. Its layers share one table; its pages
    come from its own allocator, as each layer has its own pool."""

    ring: bool
    sequence_pages: int  # the most pages one sequence holds: M_w, or its longest length's
    num_pages: int  # its allocator's pages: every row at its most, and the prompt cache
    layers: tuple[int, ...] | None  # None: every layer (the draft does not mix kinds)
    peak_pages_in_use: int = 0
    ring_page_reuses: int = 0  # pages overwritten in place after the window moved past them
    most_pages_per_sequence: int = 0  # the most pages one sequence's table held at once


@dataclasses.dataclass
class Sequence:
    serial: int
    prompt: Prompt
    stream: int  # feature stream of its own tokens
    target_length: int
    length: int  # tokens held: the next position to write
    slots: list[list[int]]  # per kind: page id per ring / page slot, -1 when none
    own: list[set[int]]  # per kind: slots holding a page this sequence allocated


@dataclasses.dataclass
class Steps:
    """Token-major inputs of a run of steps (``[n, T]`` int32, the tables ``[n, B, 2, M]``, or
    ``[n, layers, B, 2, M]`` for a draft that mixes windowed and full layers)."""

    positions: np.ndarray
    owners: np.ndarray  # table row of each token, -1: padding
    streams: np.ndarray  # feature stream of each token, -1: padding
    tables: np.ndarray

    @property
    def count(self) -> int:
        return self.positions.shape[0]


@dataclasses.dataclass
class FinalSequence:
    """A sequence in flight after the last step, for the read-back check."""

    row: int
    prompt_id: int
    prompt_length: int
    stream: int
    length: int
    visible_starts: tuple[int, ...]  # per kind: the first position its pages still hold

    @property
    def visible_start(self) -> int:
        """The first position any kind's pages still hold (a window drops older ones)."""
        return min(self.visible_starts)


@dataclasses.dataclass
class PagedPlan:
    batch: int
    block_size: int
    page_size: int
    table_pages: int  # M
    ring: bool | tuple[bool, ...]  # the op's ring: one for every layer, or one per layer
    num_pages: int  # N of the pool: the largest kind's
    max_length: int
    kinds: tuple[PageKind, ...]
    prompts: list[Prompt]
    prefill: Steps
    decode: Steps
    accepted: np.ndarray  # [steps] generated tokens accepted per step
    written: np.ndarray  # [steps] tokens written per step (prompt tails included)
    final: list[FinalSequence]
    sequences_started: int
    sequences_finished: int
    shared_page_references: int  # prompt pages referenced by sequences (not written again)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.block_size

    @property
    def accepted_tokens(self) -> int:
        return int(self.accepted.sum())

    @property
    def mixed(self) -> bool:
        """Whether windowed and full layers hold their own kinds of pages (per-layer tables)."""
        return len(self.kinds) > 1

    @property
    def peak_pages_in_use(self) -> int:
        return max(k.peak_pages_in_use for k in self.kinds)

    @property
    def ring_page_reuses(self) -> int:
        return sum(k.ring_page_reuses for k in self.kinds)

    @property
    def prompt_pages(self) -> int:
        return sum(len(p.pages) for p in self.prompts)

    @property
    def full_layer_pages(self) -> int:
        """The pages a full layer's pool needs for this run (the same draft with no window)."""
        return pool_pages_for(self.batch, -(-self.max_length // self.page_size), self.prompt_pages)

    def kind_of(self, layer: int) -> int:
        """Index in :attr:`kinds` of ``layer``'s pages."""
        return next(n for n, k in enumerate(self.kinds) if k.layers is None or layer in k.layers)

    def kind_tables(self, tables: np.ndarray) -> list[np.ndarray]:
        """One step's ``[B, 2, M]`` table of each kind, from its ``tables``."""
        if not self.mixed:
            return [tables]
        return [tables[k.layers[0]] for k in self.kinds]


def table_pages_for(page_size: int, pages_per_sequence: int, window: int | None) -> int:
    """M: a sequence's pages at its longest, or the window's pages plus the one being filled."""
    return pages_per_sequence if window is None else window // page_size + 1


def mixed_table_pages(page_size: int, pages_per_sequence: int, window: int) -> int:
    """M of a draft mixing windowed and full layers: the full layers' pages rounded up to a
    multiple of the window's ring pages, so that a repeated ring wraps where the op wraps."""
    ring = table_pages_for(page_size, pages_per_sequence, window)
    return -(-pages_per_sequence // ring) * ring


def pool_pages_for(batch: int, table_pages: int, prompt_pages: int) -> int:
    """Pages a run can hold at once: every row at its most pages, and the prompt cache."""
    return batch * table_pages + prompt_pages


def plan_paged_run(
    rng: np.random.Generator,
    accept,
    *,
    steps: int,
    batch: int,
    block_size: int,
    page_size: int,
    max_length: int,
    window: int | None = None,
    window_layers: tuple[bool, ...] | None = None,
    num_prompts: int | None = None,
    num_pages: int | None = None,
) -> PagedPlan:
    """The whole paged run, decided on the host (see the module docstring). ``accept`` has
    ``sample(rng, shape, block_size)``; ``window_layers``: per layer, whether it keeps the
    window (a draft mixing windowed and full layers; None: every layer alike); ``num_pages``
    caps every kind's pool, which defaults to what the run can hold."""
    if window_layers is not None and (
        window is None or all(window_layers) or not any(window_layers)
    ):
        raise ValueError(
            f"window_layers: expected a mix of windowed and full layers with a window, got "
            f"{window_layers} with window {window}"
        )
    P = page_size
    longest = -(-max_length // P)
    num_prompts = max(1, batch // 2) if num_prompts is None else num_prompts
    # A prompt longer than the window would outgrow the ring before the sequence starts.
    longest_prompt = max_length // 2 if window is None else min(max_length // 2, window)
    lengths = rng.integers(P, max(longest_prompt, P) + 1, num_prompts)
    prompt_pages = int(sum(int(n) // P for n in lengths))
    kinds = _kinds(P, longest, window, window_layers)
    for kind in kinds:
        kind.num_pages = (
            pool_pages_for(batch, kind.sequence_pages, prompt_pages)
            if num_pages is None
            else num_pages
        )
    M = kinds[0].sequence_pages if len(kinds) == 1 else mixed_table_pages(P, longest, window)
    pools = [PageAllocator(kind.num_pages) for kind in kinds]
    prompts = [
        Prompt(k, int(n), [[pages.alloc() for _ in range(int(n) // P)] for pages in pools])
        for k, n in enumerate(lengths)
    ]
    shape = _Shape(batch, block_size, P, M, max(kind.num_pages for kind in kinds))
    engine = _Engine(rng, kinds, pools, prompts, shape, max_length=max_length)
    prefill = engine.prefill()
    engine.run(accept.sample(rng, (steps, batch), block_size))
    for kind, pages in zip(kinds, pools):
        kind.peak_pages_in_use = pages.peak_in_use
    layer_tables = None if window_layers is None else [0 if w else 1 for w in window_layers]
    return PagedPlan(
        batch,
        block_size,
        P,
        M,
        window is not None if window_layers is None else tuple(window_layers),
        shape.num_pages,
        max_length,
        tuple(kinds),
        prompts,
        _per_layer(prefill, layer_tables),
        _per_layer(engine.decode, layer_tables),
        engine.accepted,
        engine.written,
        engine.final,
        engine.started,
        engine.finished,
        engine.shared_refs,
    )


def _kinds(page_size: int, longest: int, window, window_layers) -> list[PageKind]:
    """The kinds of pages: the windowed layers' ring first, then the full layers' list."""
    ring = table_pages_for(page_size, longest, window)
    if window_layers is None:
        return [PageKind(window is not None, ring, 0, None)]
    windowed = tuple(n for n, w in enumerate(window_layers) if w)
    full = tuple(n for n, w in enumerate(window_layers) if not w)
    return [PageKind(True, ring, 0, windowed), PageKind(False, longest, 0, full)]


def _per_layer(steps: Steps, layer_kinds: list[int] | None) -> Steps:
    """The steps with each layer's table (``[n, layers, B, 2, M]``) from the kinds' tables
    (``[n, kinds, B, 2, M]``); with one kind, its tables (``[n, B, 2, M]``)."""
    tables = steps.tables[:, 0] if layer_kinds is None else steps.tables[:, layer_kinds]
    return Steps(steps.positions, steps.owners, steps.streams, np.ascontiguousarray(tables))


@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    block_size: int
    page_size: int
    table_pages: int  # M
    num_pages: int  # N

    @property
    def tokens(self) -> int:  # T
        return self.batch * self.block_size

    def empty_steps(self, n: int, kinds: int) -> Steps:
        def rows(*shape):
            return np.full((n, *shape), -1, np.int32)

        T = self.tokens
        return Steps(rows(T), rows(T), rows(T), rows(kinds, self.batch, 2, self.table_pages))


class _Engine:
    """The engine's steps: the prompts' prefill, then the decode: a sequence per table row,
    started from a random prompt, growing by its accepted tokens, finishing at its length (and
    replaced at the next step). Every kind of pages follows the same sequences."""

    def __init__(self, rng, kinds, pools, prompts, shape: _Shape, *, max_length):
        self.rng, self.kinds, self.pools, self.prompts = rng, kinds, pools, prompts
        self.shape, self.max_length = shape, max_length
        self.rows: list[Sequence | None] = [None] * shape.batch
        self.serial = self.started = self.finished = self.shared_refs = 0
        self.final: list[FinalSequence] = []

    def _table(self, k: int, slots) -> np.ndarray:
        """Table rows ``[rows, 2, M]`` of kind ``k`` from sequences' slots ``[rows, M_k]``: a
        ring repeated over the table's width, a list padded with -1."""
        M = self.shape.table_pages
        held = np.asarray(slots, np.int64)
        if self.kinds[k].ring:
            held = held[:, np.arange(M) % held.shape[1]]
        else:
            held = np.pad(held, ((0, 0), (0, M - held.shape[1])), constant_values=-1)
        return np.stack([held, np.where(held >= 0, held + self.shape.num_pages, -1)], axis=1)

    def prefill(self) -> Steps:
        """Every prompt's full pages, T tokens a step, at most one prompt per table row."""
        P, shape = self.shape.page_size, self.shape
        queue = [(p, pos) for p in self.prompts for pos in range(len(p.pages) * P)]
        chunks = []
        i = 0
        while i < len(queue):
            rows: dict[int, int] = {}
            tokens = []
            while i < len(queue) and len(tokens) < shape.tokens:
                prompt, pos = queue[i]
                if prompt.id not in rows and len(rows) == shape.batch:
                    break
                rows.setdefault(prompt.id, len(rows))
                tokens.append((rows[prompt.id], prompt, pos))
                i += 1
            chunks.append((rows, tokens))
        prefill = shape.empty_steps(len(chunks), len(self.kinds))
        for n, (rows, tokens) in enumerate(chunks):
            for prompt_id, row in rows.items():
                for k, kind in enumerate(self.kinds):
                    slots = [-1] * kind.sequence_pages
                    for j, page in enumerate(self.prompts[prompt_id].pages_by_kind[k]):
                        slots[j % kind.sequence_pages] = page
                    prefill.tables[n, k, row] = self._table(k, [slots])[0]
            for t, (row, prompt, pos) in enumerate(tokens):
                prefill.positions[n, t], prefill.owners[n, t], prefill.streams[n, t] = (
                    pos,
                    row,
                    prompt.id,
                )
        return prefill

    def start(self) -> Sequence:
        prompt = self.prompts[int(self.rng.integers(0, len(self.prompts)))]
        slots = []
        for k, kind in enumerate(self.kinds):
            held = [-1] * kind.sequence_pages
            for j, page in enumerate(prompt.pages_by_kind[k]):
                held[j % kind.sequence_pages] = self.pools[k].share(page)
            slots.append(held)
        self.shared_refs += len(prompt.pages)
        target = int(self.rng.integers(prompt.length + 1, self.max_length + 1))
        length = len(prompt.pages) * self.shape.page_size
        stream = len(self.prompts) + self.serial
        own = [set() for _ in self.kinds]
        seq = Sequence(self.serial, prompt, stream, target, length, slots, own)
        self.serial += 1
        self.started += 1
        return seq

    def page_for(self, seq: Sequence, pos: int) -> None:
        """Every kind's page of position ``pos``: a new one where ``pos`` starts a page."""
        for k, kind in enumerate(self.kinds):
            M, slots, own = kind.sequence_pages, seq.slots[k], seq.own[k]
            slot = (pos // self.shape.page_size) % M if kind.ring else pos // self.shape.page_size
            current = slots[slot]
            if pos % self.shape.page_size == 0:  # a page's first row: the slot's old page is done
                if current != -1 and slot in own:
                    kind.ring_page_reuses += 1  # its tokens all left the window: overwrite it
                    continue
                if current != -1:
                    self.pools[k].release(current)  # a shared prompt page: never written again
                slots[slot] = self.pools[k].alloc()
                own.add(slot)
                held = sum(page != -1 for page in slots)
                kind.most_pages_per_sequence = max(kind.most_pages_per_sequence, held)
            elif current == -1:
                raise AssertionError(f"position {pos} starts in the middle of an unallocated page")

    def run(self, drawn: np.ndarray) -> None:
        steps = drawn.shape[0]
        self.decode = self.shape.empty_steps(steps, len(self.kinds))
        self.accepted = np.zeros(steps, np.int64)
        self.written = np.zeros(steps, np.int64)
        for i in range(steps):
            for b in range(self.shape.batch):
                self._grow(i, b, int(drawn[i, b]))
            for k in range(len(self.kinds)):
                self.decode.tables[i, k] = self._table(k, [seq.slots[k] for seq in self.rows])
            if i == steps - 1:
                self.final = self._final()
            self._finish()

    def _grow(self, i: int, b: int, drawn: int) -> None:
        """Row ``b``'s tokens at step ``i``: its prompt's tail first, then what it accepted."""
        if self.rows[b] is None:
            self.rows[b] = self.start()
        seq = self.rows[b]
        if seq.length < seq.prompt.length:  # the prompt's tail: this sequence's own page
            n = min(self.shape.block_size, seq.prompt.length - seq.length)
        else:
            n = min(drawn, seq.target_length - seq.length)
            self.accepted[i] += n
        if n <= 0:
            return
        P, first = self.shape.page_size, seq.length
        if first % P:
            self.page_for(seq, first)  # checks that its page is there
        for pos in range(first + -first % P, first + n, P):  # each page it starts
            self.page_for(seq, pos)
        k = b * self.shape.block_size
        pos = np.arange(first, first + n)
        self.decode.positions[i, k : k + n] = pos
        self.decode.owners[i, k : k + n] = b
        self.decode.streams[i, k : k + n] = np.where(
            pos < seq.prompt.length, seq.prompt.id, seq.stream
        )
        self.written[i] += n
        seq.length += n

    def _finish(self) -> None:
        for b, seq in enumerate(self.rows):
            if seq.length >= seq.target_length:  # done: its pages go back to the pools
                for pages, slots in zip(self.pools, seq.slots):
                    for page in slots:
                        if page != -1:
                            pages.release(page)
                self.rows[b] = None
                self.finished += 1

    def _final(self) -> list[FinalSequence]:
        """The sequences of the last step (those about to finish included: nothing reused
        their pages yet) with what each kind's pages still hold."""
        P = self.shape.page_size
        final = []
        for b, seq in enumerate(self.rows):
            visible = tuple(
                max(0, ((seq.length - 1) // P - kind.sequence_pages + 1) * P) if kind.ring else 0
                for kind in self.kinds
            )
            final.append(
                FinalSequence(b, seq.prompt.id, seq.prompt.length, seq.stream, seq.length, visible)
            )
        return final
