"""A screening experiment (2026-12-03): a decode step's layers run as two (or four) independent
groups of rows on their own CUDA streams (branches of the captured graph), joined before the
output embedding, which runs once over every row; against the step as one group.

Why: at 256 rows the step is a chain of ~220 kernels each short of the GPU's limits for its own
reason (the MLP's products on one wave of 116 tiles, attention bound by each program's chain of
memory round trips, 15 of 64 warp slots an SM busy). Two independent chains let one group's
attention or norm run while the other's product holds the matrix units, as SGLang's two-batch
overlap does for communication. The weights are read by both groups; if they run a layer
apart, the second group's reads come from L2.

    python bench/experiments/two_streams.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

VARIANTS = {"one": 1, "two": 2, "four": 4}


class Grouped:
    """`Decoder.decode` with the rows in `groups` equal groups, each on its own stream."""

    def __init__(self, decoder, groups: int):
        self.decoder, self.groups, self.streams = decoder, groups, {}
        self.active: int | None = None  # the group whose kernels are being queued

    def _stream(self, index: int) -> torch.cuda.Stream:
        if index not in self.streams:
            self.streams[index] = torch.cuda.Stream()
        return self.streams[index]

    def __call__(self, tokens, positions, block_tables, num_splits):
        d = self.decoder
        batch = tokens.shape[0]
        size = batch // self.groups
        if self.groups == 1 or size < 32 or batch % self.groups:
            return type(d).decode(d, tokens, positions, block_tables, num_splits)
        bs = d.cache.shape.block_size
        programs = size * d.config.num_key_value_heads
        splits = max(1, min(16, -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)))
        main = torch.cuda.current_stream()
        hidden = []
        for g in range(self.groups):
            rows = slice(g * size, (g + 1) * size)
            pos, table = positions[rows], block_tables[rows]

            def attend(layer_index, q, k, v, pos=pos, table=table):
                k_cache, v_cache = d.cache.layer(layer_index)
                q_norm, k_norm = d._qk_norms(layer_index)
                return d.ops.rope_decode_attention(q, k, v, q_norm, k_norm, d.eps, d.rope, pos, k_cache, v_cache,
                                                   table, bs, splits)

            stream = self._stream(g)
            stream.wait_stream(main)
            self.active = g
            with torch.cuda.stream(stream):
                hidden.append(d._layers(tokens[rows], attend))
            self.active = None
        for g in range(self.groups):
            main.wait_stream(self._stream(g))
            hidden[g].record_stream(main)
        return F.linear(torch.cat(hidden), d.model.output_weight)


def apply(core, name: str) -> None:
    decoder = core.runner.decoder
    decoder.__dict__.pop("decode", None)
    ops = core.ops
    ops.__dict__.pop("_counter", None)
    if VARIANTS[name] > 1:
        grouped = decoder.decode = Grouped(decoder, VARIANTS[name])
        base = type(ops)._counter

        def counter(device, size, kind):  # split counters of their own for every group
            return base(ops, device, size, kind if grouped.active is None else f"{kind}@{grouped.active}")

        ops._counter = counter


def main() -> None:
    alternate(*cli(VARIANTS, [256, 128]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
