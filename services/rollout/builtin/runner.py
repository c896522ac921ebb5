"""The model runner: rows' state on the device, prefill, and decode steps replayed as CUDA graphs.

Every running row (one sample) occupies a slot of fixed-size device tensors: its next input
token and position, its block table, how many tokens it has made, whether it is done, and its
outputs so far. A decode step reads and updates only these tensors (forward, sample, record,
check for a stop token or the length limit), so it needs nothing from the host and the same
step can be captured once per batch-size bucket and replayed: the host looks at the rows only
every few steps (`Scheduler`). Rows sit in slots [0, num_rows); a bucket's graph computes the
first `bucket` slots, and slots past num_rows are padding rows that are done and write to the
trash block.

A prefill is captured too, once per padded (prompts, length) shape (`prefill_shape`): eager,
its few hundred launches cost ~15 ms of host time however small the batch, as much as 15
decode steps of the 0.5B model.

Sampling settings live in device tensors too, so graphs survive a change of temperature or
top-p; top-k (a shape) and greedy (a different kernel) pick the graph. Graphs hold the
addresses of weights, KV cache and these tensors: the weights stay put (`forward.fuse_projections`,
updates copy into them), and `drop_graphs` forgets the graphs when memory is released.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import dataclass

import numpy
import torch

from services import devices
from services.rollout.builtin import sampling
from services.rollout.builtin.forward import PagedDecoder
from services.rollout.builtin.kv_cache import TRASH_BLOCK, PagedKVCache, to_device
from services.rollout.builtin.state import RowState
from services.rollout.types import PackedPrompts

log = logging.getLogger("rlfleet.rollout")

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class StepMode:
    """What picks a captured graph besides the batch bucket."""

    greedy: bool
    top_k: int
    top_p: bool


MAX_GRAPH_PREFILL_TOKENS = 16384  # padded groups x length of the largest prefill run as a graph
MAX_PREFILL_GRAPHS = 48  # shapes captured at most (each holds its inputs, a few KB); others run eagerly


# Prompt lengths a GPU prefill is padded to: 16, 32, 48, 64, 96, 128, 192, ... (2^k and 3 * 2^k).
_PREFILL_LENGTHS = tuple(sorted({m << k for k in range(4, 24) for m in (1, 3)}))


def _bucketed(groups: int, length: int) -> bool:
    """A padded prefill shape (a power of two of prompts, a length of `_PREFILL_LENGTHS`) within
    the graph token budget: the shapes prefills are padded to, and the only ones captured."""
    return groups & (groups - 1) == 0 and length in _PREFILL_LENGTHS and groups * length <= MAX_GRAPH_PREFILL_TOKENS


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def _lists(values: torch.Tensor) -> list:
    """A tensor's values as (nested) Python ints, floats or bools, the same as `Tensor.tolist`
    gives, through a host copy and numpy (3.5 against 23 ms for 256 x 128 tokens and logprobs on
    a 2-core host): the rows' state at a read and their tokens for stop strings, time the device
    sits idle. The copy keeps the engine's own storage from ever being exported to numpy."""
    return values.to("cpu", copy=True).numpy().tolist()


def padded(rows: list[list[int]], width: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor [len(rows), width] of `rows` right-padded with `fill`. Built in an array, not
    by torch.tensor of nested lists, which takes ~100 ns an element: 4.8 against 0.1 ms for 256
    block tables, host time before a prefill (and 2.3 against 0.16 ms for 256 prompts of 64
    tokens; prompt ids do not go through it, they come from `PackedPrompts`). Appending each
    row's list, not slicing in an array made of it: 0.16 against 0.22 ms."""
    flat = array.array(_TYPECODES[dtype])
    padding = [fill] * width
    for row in rows:
        if len(row) > width:
            raise ValueError(f"padded: a row of {len(row)} values does not fit in {width}")
        flat.fromlist(row)
        flat.fromlist(padding[len(row):])
    if not flat:
        return torch.empty(len(rows), width, dtype=dtype)
    return torch.frombuffer(flat, dtype=dtype).view(len(rows), width)


def _ints(values: list[int]) -> torch.Tensor:
    """A CPU tensor int64 [len(values)], built in an array (torch.tensor takes ~100 ns a value)."""
    return padded([values], len(values), 0, torch.int64).view(-1)


@dataclass
class _PrefillGraph:
    # The prefill's first layer, then the rest: launching a whole prefill's graph (~300 nodes)
    # takes ~0.4 ms of host time (measured on an H200 machine), with the device idle until it is
    # done; the first layer's graph launches in microseconds and runs while the host launches the rest.
    graphs: tuple[torch.cuda.CUDAGraph, ...]
    inputs: torch.Tensor  # tokens, lengths and tables in one (`_prefill_inputs`): a replay reads what was copied here
    logits: torch.Tensor  # [G, V] of the prefill logits buffer, written by every replay


@dataclass
class CopiedOutputs:
    """Rows' outputs on their way to the host (`ModelRunner.outputs_async`): columns
    [start, lengths[k]) of row k."""

    tokens: torch.Tensor  # int64 [rows, width - start], pinned host memory on a GPU
    logprobs: torch.Tensor  # float32 [rows, width - start]
    lengths: list[int]
    start: int
    ready: torch.cuda.Event | None  # recorded after the copies (None: already there)

    def wait(self) -> float:
        """Wait for the copies; the seconds that took."""
        if self.ready is None:
            return 0.0
        started = time.perf_counter()
        self.ready.synchronize()
        return time.perf_counter() - started

    def append_to(self, heads: list[tuple[list[int], list[float]]]) -> list[tuple[list[int], list[float]]]:
        """Append each row's outputs after those already in its lists heads[k] (which hold its
        first len(heads[k][0]) >= start), up to its length; returns `heads`. Through one list of
        all the values (numpy's tolist, `_lists`) sliced into the rows' lists: few new lists, so
        the garbage collector, which walks every new list's items, has little to walk at the
        call's end (a collection over 256 fresh lists of 128 tokens and logprobs took ~0.9 ms on
        the H200's host, with the device idle)."""
        self.wait()
        width = self.tokens.shape[1]
        tokens, logprobs = self.tokens.numpy().ravel().tolist(), self.logprobs.numpy().ravel().tolist()
        for k, ((ids, lps), end) in enumerate(zip(heads, self.lengths)):
            if end < len(ids):  # (cut back: a row that holds more than it keeps)
                del ids[end:], lps[end:]
            first, last = k * width + len(ids) - self.start, k * width + end - self.start
            ids += tokens[first:last]
            lps += logprobs[first:last]
        return heads


@dataclass
class NewRow:
    """A row entering the batch: its slot's contents after the prompt's prefill."""

    block_table: list[int]
    prompt_len: int
    key: int  # sampling.row_key
    logits_index: int  # which prefill logits row it samples its first token from
    # A preempted row coming back: the tokens and logprobs it made before (its prompt here holds
    # them too); it goes on from there, its draws those of a row never preempted.
    outputs: tuple[list[int], list[float]] | None = None


class ModelRunner:
    # Decode attention splits a row's tokens for this many programs an SM (4, 8 and 16 measured
    # within 2% either way on an H200: docs/design/engine-tuning.md).
    split_programs_per_sm = 2

    def __init__(self, decoder: PagedDecoder, cache: PagedKVCache, *, capacity: int, max_new_tokens: int,
                 max_blocks_per_row: int, use_graphs: bool):
        self.decoder, self.cache = decoder, cache
        self.device = cache.device
        self.capacity, self.max_new_tokens, self.max_blocks = capacity, max_new_tokens, max_blocks_per_row
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.vocab_size = decoder.config.vocab_size
        self.rows: RowState
        self._graphs: dict[tuple[int, StepMode], torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self._logits: torch.Tensor | None = None  # prefill logits [rows, V] (`_prefill_out`)
        self._pool = None
        self._alloc_state()

    def _alloc_state(self) -> None:
        self.rows = RowState.allocate(self.capacity, self.max_new_tokens, self.max_blocks, self.vocab_size, self.device)

    # ---- per call --------------------------------------------------------------------------

    def begin(self, *, temperature: float, top_p: float, max_new_tokens: int, stop_ids: set[int]) -> None:
        """Set this call's sampling settings (device scalars the graphs read)."""
        assert max_new_tokens <= self.max_new_tokens
        r = self.rows
        r.limit.fill_(max_new_tokens)
        r.inv_temperature.fill_(1.0 / temperature if temperature > 0 else 1.0)
        r.top_p.fill_(top_p)
        r.is_stop.zero_()
        if stop_ids:
            r.is_stop[torch.tensor(sorted(stop_ids), device=self.device)] = True
        r.done.fill_(True)
        r.block_tables.fill_(TRASH_BLOCK)
        r.positions.zero_()

    def prefill(self, prompts: PackedPrompts, indices: list[int], blocks: list[list[int]],
                cached: list[int] | None = None) -> torch.Tensor:
        """Queue the prefill of prompts `indices` of `prompts` (each once, its cache positions in
        `blocks[i]`); returns its logits [G', V], G' >= G (padding groups last), for `start`. On a
        GPU it returns once the work is queued, so what the host does next overlaps it.
        `cached[i]`: prompt i's first tokens whose keys and values the cache holds already (a
        prefix-cache hit, whole blocks): only the rest is computed."""
        if cached and any(cached):
            return self._extend_logits(prompts, indices, blocks, cached)
        return self._prefill_logits(prompts, indices, blocks)

    def _extend_logits(self, prompts: PackedPrompts, indices: list[int], blocks: list[list[int]],
                       cached: list[int]) -> torch.Tensor:
        """Prefill of prompt suffixes over cached prefixes, eager at its own shapes (no graphs)."""
        bs = self.cache.shape.block_size
        sizes = prompts.lengths[indices]
        starts = numpy.asarray(cached, dtype=numpy.int64)
        rest = sizes - starts
        whole = prompts.rows(indices, int(sizes.max()))  # [G, P]
        columns = numpy.arange(int(rest.max()), dtype=numpy.int64)
        real = columns[None, :] < rest[:, None]
        at = numpy.where(real, starts[:, None] + columns, 0)
        tokens = numpy.where(real, numpy.take_along_axis(whole, at, axis=1), 0)  # [G, S]
        width = -(-int(sizes.max()) // bs)
        tables = padded([table[: -(-n // bs)] for n, table in zip(sizes.tolist(), blocks)], width, TRASH_BLOCK,
                        torch.int64)
        device = self.device
        out = self._prefill_out(len(indices)) if device.type == "cuda" else None
        return self.decoder.extend(to_device(torch.from_numpy(tokens), device), to_device(torch.from_numpy(starts), device),
                                   to_device(torch.from_numpy(rest), device), to_device(tables, device), out=out)

    def start(self, logits: torch.Tensor, rows: list[NewRow], first_slot: int, mode: StepMode) -> None:
        """Start `rows` in slots first_slot.. with their first token, sampled from the prefill's
        `logits` (`prefill`)."""
        count = len(rows)
        width = max(len(row.block_table) for row in rows)
        # The first sampled token sits at position prompt_len; recording it advances there.
        # All in one tensor, so that one copy moves them, and the host goes on while the prefill runs.
        packed = padded([[row.key, row.prompt_len - 1, row.logits_index, len(row.outputs[0]) if row.outputs else 0,
                          *row.block_table] for row in rows], 4 + width, TRASH_BLOCK, torch.int64)
        packed = to_device(packed, self.device)  # [count, 4 + width]
        keys, positions, logits_index, made, table = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3], packed[:, 4:]
        slot = slice(first_slot, first_slot + count)
        state = self.rows
        state.block_tables[slot] = TRASH_BLOCK
        state.block_tables[slot, :width] = table
        state.keys[slot] = keys
        state.num_made[slot] = made
        for k, row in enumerate(rows):
            if row.outputs:  # (rare: a preempted row's outputs so far, back where it left them)
                ids, logprobs = row.outputs
                state.out_tokens[first_slot + k, : len(ids)] = to_device(torch.tensor(ids, dtype=torch.int64),
                                                                         self.device)
                state.out_logprobs[first_slot + k, : len(ids)] = to_device(torch.tensor(logprobs,
                                                                                        dtype=torch.float32),
                                                                           self.device)
        state.done[slot] = False
        state.positions[slot] = positions
        # Each row samples from its prompt's logits row: with one sample a prompt, in order, the
        # rows themselves (a view: no copy of [count, V] logits, 93 us at 256 x 151,936 on an H200).
        in_order = all(row.logits_index == i for i, row in enumerate(rows))
        self._record(logits[:count] if in_order else logits[logits_index], first_slot, mode)  # [count, V]

    def prefill_shape(self, groups: int, length: int) -> tuple[int, int]:
        """The (groups, length) a prefill of `groups` prompts of at most `length` tokens runs at.
        On a GPU both are rounded up to a few sizes, so that few graphs serve every prefill (with
        or without graphs: the same shapes, so the same kernels and numbers); past
        MAX_GRAPH_PREFILL_TOKENS the prefill runs as it is, its launches small beside its work."""
        if self.device.type != "cuda":
            return groups, length
        padded_groups = 1 << max(0, groups - 1).bit_length()
        padded_length = next((n for n in _PREFILL_LENGTHS if n >= length), length)
        if not _bucketed(padded_groups, padded_length) or padded_length > self.decoder.rope.shape[0]:
            return groups, length
        return padded_groups, padded_length

    def _prefill_logits(self, prompts: PackedPrompts, indices: list[int], blocks: list[list[int]]) -> torch.Tensor:
        bs = self.cache.shape.block_size
        sizes = prompts.lengths[indices]
        groups, length = self.prefill_shape(len(indices), int(sizes.max()))
        width = -(-length // bs)
        # One array each, never a tensor op per prompt (that cost ~15 ms for 256 prompts), the
        # ids from the array they were checked in, and one copy of them all to the device.
        # Padding groups are one token long, all zeros, and write to the trash block.
        pad = groups - len(indices)
        tokens = numpy.zeros((groups, length), dtype=numpy.int64)  # [G, P]
        tokens[: len(indices)] = prompts.rows(indices, length)
        lengths = numpy.concatenate((sizes, numpy.ones(pad, dtype=numpy.int64)))  # [G]
        tables = padded([table[: -(-n // bs)] for n, table in zip(sizes.tolist(), blocks)] + [[]] * pad, width,
                        TRASH_BLOCK, torch.int64)  # [G, P / block_size]
        packed = torch.cat((torch.from_numpy(tokens).view(-1), torch.from_numpy(lengths), tables.view(-1)))
        graph = self._prefill_graphs.get((groups, length))
        if self.use_graphs and graph is not None:
            graph.inputs.copy_(packed.pin_memory(), non_blocking=True)  # (as `to_device` does)
            for part in graph.graphs:
                part.replay()
            return graph.logits
        if self.use_graphs and _bucketed(groups, length) and len(self._prefill_graphs) < MAX_PREFILL_GRAPHS:
            self._prefill_graphs[(groups, length)] = graph = self._capture_prefill(packed, groups, length)
            return graph.logits
        return self._prefill_forward(*self._prefill_inputs(to_device(packed, self.device), groups, length))

    def _prefill_inputs(self, packed: torch.Tensor, groups: int, length: int) -> tuple[torch.Tensor, ...]:
        """Tokens [G, P], lengths [G] and block tables [G, P / block_size] of a prefill: views of
        int64 `packed`, which holds them one after the other."""
        width = -(-length // self.cache.shape.block_size)
        tokens, lengths, tables = packed.split((groups * length, groups, groups * width))
        return tokens.view(groups, length), lengths, tables.view(groups, width)

    def _prefill_forward(self, tokens: torch.Tensor, lengths: torch.Tensor, tables: torch.Tensor,
                         after_layer=None) -> torch.Tensor:
        """Logits [G, V] of right-padded prompts tokens [G, P], writing their keys and values to
        the cache at their block tables [G, P / block_size] (padding positions: the trash block)."""
        bs = self.cache.shape.block_size
        position = torch.arange(tokens.shape[1], device=tokens.device)
        slots = tables[:, position // bs].long() * bs + position % bs  # [G, P]
        slots = torch.where(position[None, :] < lengths[:, None], slots, TRASH_BLOCK * bs + position % bs)
        out = self._prefill_out(tokens.shape[0]) if self.device.type == "cuda" else None
        return self.decoder.prefill(tokens, lengths, slots, out=out, after_layer=after_layer)

    def _prefill_out(self, groups: int) -> torch.Tensor:
        """[groups, V] of the one buffer every GPU prefill writes its logits to, graph or not
        (the same product either way): graphs then keep no logits of their own."""
        if self._logits is None or self._logits.shape[0] < groups:
            rows = max(groups, 1 << max(0, self.capacity - 1).bit_length())
            weight = self.decoder.model.output_weight
            self._logits = torch.empty(rows, self.vocab_size, dtype=weight.dtype, device=self.device)
        return self._logits[:groups]

    def decode(self, num_rows: int, num_steps: int, mode: StepMode) -> None:
        """`num_steps` decode steps of slots [0, num_rows) (rows that finish stop changing)."""
        # On a GPU even without graphs the batch is padded to its bucket: the same shapes, so the
        # same kernels and the same numbers with and without graphs.
        bucket = self.bucket(num_rows) if self.device.type == "cuda" else num_rows
        if self.use_graphs:
            graph = self._graph(bucket, mode)
            for _ in range(num_steps):
                graph.replay()
        else:
            for _ in range(num_steps):
                self._step(bucket, mode)

    def bucket(self, num_rows: int) -> int:
        return next((b for b in _BUCKETS if b >= num_rows), self.capacity) if num_rows <= self.capacity else num_rows

    def _step(self, batch: int, mode: StepMode) -> None:
        r = self.rows
        logits = self.decoder.decode(r.tokens[:batch], r.positions[:batch], r.block_tables[:batch],
                                     self.num_splits(batch))
        self._record(logits, 0, mode)

    def num_splits(self, batch: int) -> int:
        """Enough (row, KV head, split) programs to fill the GPU at every batch size."""
        if self.device.type != "cuda":
            return 1
        programs = batch * self.decoder.config.num_key_value_heads
        return max(1, min(16, -(-self.split_programs_per_sm * devices.sm_count(self.device) // programs)))

    def _record(self, logits: torch.Tensor, start: int, mode: StepMode) -> None:
        """Sample from logits [b, V] for slots start.., record the tokens, advance the rows."""
        scores = None
        if not mode.greedy and (mode.top_k > 0 or mode.top_p):
            scores = sampling.filter_scores(logits, self.rows.inv_temperature, mode.top_k,
                                            self.rows.top_p if mode.top_p else None)
        self.decoder.ops.sample_and_record(logits, scores, mode.greedy, self.rows, start)

    # ---- host checks -----------------------------------------------------------------------

    def read(self, num_rows: int) -> tuple[list[bool], list[int]]:
        """done and num_made of slots [0, num_rows): the one host sync of a check."""
        r = self.rows
        both = _lists(torch.stack((r.done[:num_rows].int(), r.num_made[:num_rows])))
        return [bool(d) for d in both[0]], both[1]

    def outputs_async(self, slots: list[int], lengths: list[int], start: int = 0) -> CopiedOutputs:
        """The tokens and logprobs of rows `slots` from column `start` up to their `lengths`,
        copied out now in stream order (before anything queued later moves the rows), into pinned
        host memory on a GPU; `CopiedOutputs` waits for that copy alone, not for work queued after it."""
        columns = slice(start, max(start, *lengths))
        first = slots[0]
        if slots == list(range(first, first + len(slots))):  # a slice: no index to upload, no gather
            rows = slice(first, first + len(slots))
            tokens, logprobs = self.rows.out_tokens[rows, columns], self.rows.out_logprobs[rows, columns]
            if self.device.type != "cuda":  # (views of the engine's own tensors)
                tokens, logprobs = tokens.clone(), logprobs.clone()
        else:
            index = to_device(_ints(slots), self.device)
            tokens, logprobs = self.rows.out_tokens[index, columns], self.rows.out_logprobs[index, columns]
        ready = None
        if self.device.type == "cuda":
            tokens, logprobs = (t.to("cpu", non_blocking=True) for t in (tokens, logprobs))  # pinned
            ready = torch.cuda.Event()
            ready.record()
        return CopiedOutputs(tokens, logprobs, lengths, start, ready)

    def extend_tables(self, entries: list[tuple[int, int, int]]) -> None:
        """Rows' block tables grow: (slot, index, block) each, in one indexed write."""
        if entries:
            slots, index, blocks = to_device(torch.tensor(entries, dtype=torch.int64).t().contiguous(), self.device)
            self.rows.block_tables[slots, index] = blocks.to(self.rows.block_tables.dtype)

    def tokens_so_far(self, num_rows: int, width: int) -> list[list[int]]:
        return _lists(self.rows.out_tokens[:num_rows, :width])

    def finish(self, slots: list[int]) -> None:
        """Mark rows done from the host (a stop string was found)."""
        self.rows.done[to_device(_ints(slots), self.device)] = True

    def keep(self, slots: list[int]) -> None:
        """Move rows `slots` (in this order) to slots [0, len(slots)); the rest become padding."""
        count = len(slots)
        r = self.rows
        if slots != list(range(count)):
            index = to_device(_ints(slots), self.device)
            for t in r.per_row():
                t[:count] = t[index]
        r.done[count:] = True
        r.block_tables[count:] = TRASH_BLOCK
        r.positions[count:] = 0

    # ---- graphs ----------------------------------------------------------------------------

    def _graph(self, batch: int, mode: StepMode) -> torch.cuda.CUDAGraph:
        key = (batch, mode)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(batch, mode)
            self._graphs[key] = graph
        return graph

    def _capture(self, batch: int, mode: StepMode) -> torch.cuda.CUDAGraph:
        """Warm the step up once (Triton compiles, cuBLAS picks kernels), put the rows' state
        back as it was, and capture the step into the shared graph memory pool."""
        saved = [t.clone() for t in self.rows.all()]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self.decoder.ops.tuning():
            self._step(batch, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for t, s in zip(self.rows.all(), saved):
            t.copy_(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(batch, mode)
        log.debug("captured the decode step for %d rows (%s)", batch, mode)
        return graph

    def _capture_prefill(self, packed: torch.Tensor, groups: int, length: int) -> _PrefillGraph:
        """Run the prefill of host inputs `packed` (`_prefill_inputs`) once (warming it up; its
        cache writes and logits are this call's), then capture it reading a device copy of them,
        into the shared graph memory pool. Its logits go to the prefill logits buffer, outside the
        pool, read before the next prefill writes there."""
        static = to_device(packed, self.device)
        inputs = self._prefill_inputs(static, groups, length)
        self._prefill_out(groups)  # made here, on this stream, never while capturing
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self.decoder.ops.tuning():
            self._prefill_forward(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Two graphs in the one pool, captured and always replayed back to back: the first layer,
        # then the rest (what the first leaves for the second is alive across the cut).
        parts = [torch.cuda.CUDAGraph()]

        def cut(index: int) -> None:
            if index == 0:
                parts[-1].capture_end()
                parts.append(torch.cuda.CUDAGraph())
                parts[-1].capture_begin(pool=self._pool)

        torch.cuda.synchronize(self.device)  # (as torch.cuda.graph does)
        with torch.cuda.stream(torch.cuda.Stream(self.device)):
            parts[0].capture_begin(pool=self._pool)
            try:
                logits = self._prefill_forward(*inputs, after_layer=cut)
            finally:
                parts[-1].capture_end()
        log.debug("captured the prefill of %d x %d tokens in %d graphs", groups, length, len(parts))
        return _PrefillGraph(tuple(parts), static, logits)

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs) + len(self._prefill_graphs)
