"""Triton kernels for the seeded draw and the chosen token's logprob: logsumexp, the draw's sums
and the best token in one read of the logits (`_sample_chunk_kernel`, one program per row and
vocabulary chunk), the draw itself in the kernel that merges the chunks and records the token
(`_sample_record_kernel`). See `sampling.py` for the draw and the hash it shares with the torch
version.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hash32(x):
    """`sampling.hash32` in uint32: products wrap at 2**32, as the reference's masks make them."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _max_sum_exp2(x, weight):
    """max(x) and the sum of weight * exp2(x - max) over a block, x in log2 units (-inf: nothing):
    partial maxima and sums merged into one, or, with weight 1, a block's own."""
    top = tl.max(x, axis=0)
    return top, tl.sum(tl.where(x > float("-inf"), weight * tl.exp2(x - top), 0.0), axis=0)


@triton.jit
def _sample_chunk_kernel(logits_ptr, scores_ptr, inv_temp_ptr, part_ptr, tok_part_ptr, vocab, stride_logits,
                         stride_scores, NUM_CHUNKS: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                         CHUNK: tl.constexpr):
    """One vocabulary chunk of one row, read once and whole (one round trip to memory, so that
    enough bytes are in flight for the bandwidth): the max and exp-sum of the raw logits (for the
    logprob's logsumexp) and, greedy, the best logit and its token, or, sampling, the max and
    exp-sum of the scores (for the draw's running sums, `sampling.py`), in log2 units. At
    temperature 1 the scores are the logits: one sum serves both."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    c = tl.program_id(1)
    v = c * CHUNK + tl.arange(0, CHUNK)
    ok = v < vocab
    inv_temp = tl.load(inv_temp_ptr)
    tl.extra.cuda.gdc_wait()  # the logits' product has finished
    tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(logits_ptr + row * stride_logits + v, mask=ok, other=float("-inf")).to(tl.float32)
    chunk_max, chunk_total = _max_sum_exp2(x * LOG2E, 1.0)
    part = (row * NUM_CHUNKS + c) * 4
    tl.store(part_ptr + part, chunk_max)
    tl.store(part_ptr + part + 1, chunk_total)
    if GREEDY:
        best = tl.max(x, axis=0)
        tl.store(part_ptr + part + 2, best)
        tl.store(tok_part_ptr + row * NUM_CHUNKS + c, tl.min(tl.where(x == best, v, 2147483647), axis=0))  # lowest id
    else:
        score_max, score_total = chunk_max, chunk_total
        if SCALE_SCORES:
            if inv_temp != 1.0:
                score_max, score_total = _max_sum_exp2(x * (inv_temp * LOG2E), 1.0)
        else:
            score = tl.load(scores_ptr + row * stride_scores + v, mask=ok, other=float("-inf")).to(tl.float32)
            score_max, score_total = _max_sum_exp2(score * LOG2E, 1.0)
        tl.store(part_ptr + part + 2, score_max)
        tl.store(part_ptr + part + 3, score_total)


@triton.jit
def _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp, key, step,
                  vocab, r, NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr,
                  SCALE_SCORES: tl.constexpr, CHUNK: tl.constexpr):
    """Row r's token and the raw logprob of it. Greedy: the best logit over the chunks (the
    lowest id on a tie). Sampling (`sampling.draw`): u from the (key, step) hash picks the chunk
    whose running sum of chunk totals passes u times the row's total, then the token in it whose
    running sum of weights passes what is left (the chunk's weights summed again here, in the
    same units; if rounding leaves the target past their sum, the chunk's last token of weight
    above 0)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < NUM_CHUNKS
    part = (r * NUM_CHUNKS + c) * 4
    m = tl.load(part_ptr + part, mask=ok, other=float("-inf"))
    total = tl.load(part_ptr + part + 1, mask=ok, other=0.0)
    top, row_total = _max_sum_exp2(m, total)
    lse = (top + tl.log2(row_total)) * LN2
    if GREEDY:
        best = tl.load(part_ptr + part + 2, mask=ok, other=float("-inf"))
        toks = tl.load(tok_part_ptr + r * NUM_CHUNKS + c, mask=ok, other=2147483647)
        token = tl.min(tl.where(best == tl.max(best, axis=0), toks, 2147483647), axis=0)  # chunks hold ascending ids
    else:
        score_max = tl.load(part_ptr + part + 2, mask=ok, other=float("-inf"))
        score_total = tl.load(part_ptr + part + 3, mask=ok, other=0.0)
        big = tl.max(score_max, axis=0)
        shares = tl.where(score_max > float("-inf"), score_total * tl.exp2(score_max - big), 0.0)
        running = tl.cumsum(shares, axis=0)
        bits = _hash32(key + step * 0x9E3779B9) >> 8
        target = ((bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)) * tl.max(running, axis=0)
        pick = tl.min(tl.where((running > target) & ok, c, CHUNKS_PAD), axis=0)
        pick = tl.where(pick == CHUNKS_PAD, tl.max(tl.where(shares > 0, c, 0), axis=0), pick)
        target -= tl.sum(tl.where(c == pick, running - shares, 0.0), axis=0)
        v = pick * CHUNK + tl.arange(0, CHUNK)
        v_ok = v < vocab
        if SCALE_SCORES:
            score = tl.load(logits_ptr + r * stride_logits + v, mask=v_ok, other=float("-inf")).to(tl.float32) * (
                inv_temp * LOG2E)
        else:
            score = tl.load(scores_ptr + r * stride_scores + v, mask=v_ok, other=float("-inf")).to(tl.float32) * LOG2E
        weight = tl.where(score > float("-inf"), tl.exp2(score - big), 0.0)
        passed = (tl.cumsum(weight, axis=0) > target) & (weight > 0)
        token = tl.min(tl.where(passed, v, 2147483647), axis=0)
        token = tl.where(token == 2147483647, tl.max(tl.where(weight > 0, v, 0), axis=0), token)
    logprob = tl.load(logits_ptr + r * stride_logits + token).to(tl.float32) - lse
    return token, logprob


@triton.jit
def _sample_merge_kernel(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp_ptr,
                         keys_ptr, steps_ptr, tok_ptr, lp_ptr, vocab, NUM_CHUNKS: tl.constexpr,
                         CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                         CHUNK: tl.constexpr):
    row = tl.program_id(0)
    token, logprob = _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores,
                                   tl.load(inv_temp_ptr), tl.load(keys_ptr + row).to(tl.uint32),
                                   tl.load(steps_ptr + row).to(tl.uint32), vocab, row, NUM_CHUNKS, CHUNKS_PAD, GREEDY,
                                   SCALE_SCORES, CHUNK)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(lp_ptr + row, logprob)


@triton.jit
def _sample_record_kernel(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp_ptr,
                          keys_ptr, vocab, start, tokens_ptr, positions_ptr, made_ptr, done_ptr, out_tok_ptr,
                          out_lp_ptr, out_width, limit_ptr, is_stop_ptr, NUM_CHUNKS: tl.constexpr,
                          CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                          CHUNK: tl.constexpr):
    """Merge a row's chunks into its token and logprob, and record them (as
    `TorchOps.sample_and_record` does), all in one program per row. The draw's step is the
    row's tokens made so far."""
    r = tl.program_id(0)
    row = start + r
    key = tl.load(keys_ptr + row).to(tl.uint32)
    inv_temp = tl.load(inv_temp_ptr)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    made = tl.load(made_ptr + row)
    token, logprob = _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores,
                                   inv_temp, key, made.to(tl.uint32), vocab, r, NUM_CHUNKS, CHUNKS_PAD, GREEDY,
                                   SCALE_SCORES, CHUNK)
    active = tl.load(done_ptr + row) == 0
    if active:
        at = tl.minimum(made, out_width - 1).to(tl.int64)
        tl.store(out_tok_ptr + row * out_width + at, token.to(tl.int64))
        tl.store(out_lp_ptr + row * out_width + at, logprob)
        made += 1
        stop = tl.load(is_stop_ptr + token) != 0
        tl.store(made_ptr + row, made)
        tl.store(done_ptr + row, (stop | (made >= tl.load(limit_ptr))).to(tl.int1))
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)
