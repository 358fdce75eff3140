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
    pages: list[int]  # its full pages, shared


@dataclasses.dataclass
class Sequence:
    serial: int
    prompt: Prompt
    stream: int  # feature stream of its own tokens
    target_length: int
    length: int  # tokens held: the next position to write
    slots: list[int]  # page id per table slot, -1 when none
    own: set[int]  # slots holding a page this sequence allocated


@dataclasses.dataclass
class Steps:
    """Token-major inputs of a run of steps (``[n, T]`` / ``[n, B, 2, M]`` int32)."""

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
    visible_start: int  # first position its pages still hold (a window drops older ones)


@dataclasses.dataclass
class PagedPlan:
    batch: int
    block_size: int
    page_size: int
    table_pages: int  # M
    ring: bool
    num_pages: int  # N of the pool
    max_length: int
    prompts: list[Prompt]
    prefill: Steps
    decode: Steps
    accepted: np.ndarray  # [steps] generated tokens accepted per step
    written: np.ndarray  # [steps] tokens written per step (prompt tails included)
    final: list[FinalSequence]
    sequences_started: int
    sequences_finished: int
    peak_pages_in_use: int
    shared_page_references: int  # prompt pages referenced by sequences (not written again)
    ring_page_reuses: int  # pages overwritten in place after the window moved past them

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.block_size

    @property
    def accepted_tokens(self) -> int:
        return int(self.accepted.sum())


def table_pages_for(page_size: int, pages_per_sequence: int, window: int | None) -> int:
    """M: a sequence's pages at its longest, or the window's pages plus the one being filled."""
    return pages_per_sequence if window is None else window // page_size + 1


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
    num_prompts: int | None = None,
    num_pages: int | None = None,
) -> PagedPlan:
    """The whole paged run, decided on the host (see the module docstring). ``accept`` has
    ``sample(rng, shape, block_size)``; ``num_pages`` defaults to what the run can hold."""
    P = page_size
    M = table_pages_for(P, -(-max_length // P), window)
    num_prompts = max(1, batch // 2) if num_prompts is None else num_prompts
    longest_prompt = max_length // 2 if window is None else min(max_length // 2, window)
    lengths = rng.integers(P, max(longest_prompt, P) + 1, num_prompts)
    if num_pages is None:
        num_pages = pool_pages_for(batch, M, int(sum(int(n) // P for n in lengths)))
    pages = PageAllocator(num_pages)
    prompts = [
        Prompt(k, int(n), [pages.alloc() for _ in range(int(n) // P)])
        for k, n in enumerate(lengths)
    ]
    shape = _Shape(batch, block_size, P, M, num_pages)
    prefill = _prefill(prompts, shape)
    engine = _Engine(rng, pages, prompts, shape, ring=window is not None, max_length=max_length)
    engine.run(accept.sample(rng, (steps, batch), block_size))
    return PagedPlan(
        batch,
        block_size,
        P,
        M,
        window is not None,
        num_pages,
        max_length,
        prompts,
        prefill,
        engine.decode,
        engine.accepted,
        engine.written,
        engine.final,
        engine.started,
        engine.finished,
        pages.peak_in_use,
        engine.shared_refs,
        engine.ring_reuses,
    )


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

    def empty_steps(self, n: int) -> Steps:
        def rows(*shape):
            return np.full((n, *shape), -1, np.int32)

        T = self.tokens
        return Steps(rows(T), rows(T), rows(T), rows(self.batch, 2, self.table_pages))


def _prefill(prompts: list[Prompt], shape: _Shape) -> Steps:
    """Every prompt's full pages, T tokens a step, at most one prompt per table row."""
    P, M = shape.page_size, shape.table_pages
    queue = [(p, pos) for p in prompts for pos in range(len(p.pages) * P)]
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
    prefill = shape.empty_steps(len(chunks))
    for n, (rows, tokens) in enumerate(chunks):
        for prompt_id, row in rows.items():
            for j, page in enumerate(prompts[prompt_id].pages):
                prefill.tables[n, row, :, j % M] = (page, page + shape.num_pages)
        for t, (row, prompt, pos) in enumerate(tokens):
            prefill.positions[n, t], prefill.owners[n, t], prefill.streams[n, t] = (
                pos,
                row,
                prompt.id,
            )
    return prefill


class _Engine:
    """The engine's decode steps: a sequence per table row, started from a random prompt,
    growing by its accepted tokens, finishing at its length (and replaced at the next step)."""

    def __init__(self, rng, pages: PageAllocator, prompts, shape: _Shape, *, ring, max_length):
        self.rng, self.pages, self.prompts, self.shape = rng, pages, prompts, shape
        self.ring, self.max_length = ring, max_length
        self.rows: list[Sequence | None] = [None] * shape.batch
        self.serial = self.started = self.finished = self.shared_refs = self.ring_reuses = 0
        self.final: list[FinalSequence] = []

    def start(self) -> Sequence:
        prompt = self.prompts[int(self.rng.integers(0, len(self.prompts)))]
        slots = [-1] * self.shape.table_pages
        for j, page in enumerate(prompt.pages):
            slots[j % self.shape.table_pages] = self.pages.share(page)
            self.shared_refs += 1
        target = int(self.rng.integers(prompt.length + 1, self.max_length + 1))
        length = len(prompt.pages) * self.shape.page_size
        stream = len(self.prompts) + self.serial
        seq = Sequence(self.serial, prompt, stream, target, length, slots, set())
        self.serial += 1
        self.started += 1
        return seq

    def page_for(self, seq: Sequence, pos: int) -> int:
        P, M = self.shape.page_size, self.shape.table_pages
        slot = (pos // P) % M if self.ring else pos // P
        current = seq.slots[slot]
        if pos % P == 0:  # the first row of a page: the slot's old page (if any) is done
            if current != -1 and slot in seq.own:
                self.ring_reuses += 1  # its tokens all left the window: overwrite in place
                return slot
            if current != -1:
                self.pages.release(current)  # a shared prompt page: never written again
            seq.slots[slot] = self.pages.alloc()
            seq.own.add(slot)
        elif current == -1:
            raise AssertionError(f"position {pos} starts in the middle of an unallocated page")
        return slot

    def run(self, drawn: np.ndarray) -> None:
        steps = drawn.shape[0]
        self.decode = self.shape.empty_steps(steps)
        self.accepted = np.zeros(steps, np.int64)
        self.written = np.zeros(steps, np.int64)
        for i in range(steps):
            for b in range(self.shape.batch):
                self._grow(i, b, int(drawn[i, b]))
            live = np.array([seq.slots for seq in self.rows], np.int64)  # [B, M]
            self.decode.tables[i, :, 0] = live
            self.decode.tables[i, :, 1] = np.where(live >= 0, live + self.shape.num_pages, -1)
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
            if seq.length >= seq.target_length:  # done: its pages go back to the pool
                for page in seq.slots:
                    if page != -1:
                        self.pages.release(page)
                self.rows[b] = None
                self.finished += 1

    def _final(self) -> list[FinalSequence]:
        """The sequences of the last step (those about to finish included: nothing reused
        their pages yet) with what their pages still hold."""
        P, M = self.shape.page_size, self.shape.table_pages
        final = []
        for b, seq in enumerate(self.rows):
            visible = max(0, ((seq.length - 1) // P - M + 1) * P) if self.ring else 0
            final.append(
                FinalSequence(b, seq.prompt.id, seq.prompt.length, seq.stream, seq.length, visible)
            )
        return final
