"""The eager reference generator: batched sampling from a `DecoderLM` with its dense KV cache.

The rollout service runs the paged engine (`services.rollout.builtin`); this plain loop over the
model's own forward is kept as the reference that engine is tested and benchmarked against
(`bench/rollout.py` reports both). Prompts are repeated `n` times, left-padded into batches,
prefilled once and then decoded one token per step; sequences that finish are dropped from the
batch once enough of them have. The conventions of `services.rollout.types` hold here too; with
a `seed`, the same prompts, sampling settings and `max_batch_size` give the same outputs (one
torch generator drives each batch, so changing the batching changes the draws).
"""

from __future__ import annotations

import torch

from services.models.decoder import DecoderLM, KVCache
from services.models.tokenizer import Tokenizer
from services.rollout.types import Generation, Sampling, validate_prompts

# Drop finished rows from the KV cache once at most this fraction of the rows is still running:
# a copy of the cache costs about as much as a few decode steps, so doing it on every finish
# would cost more than it saves.
_COMPACT_FRACTION = 0.75


def generate(
    model: DecoderLM,
    tokenizer: Tokenizer,
    prompts_ids: list[list[int]],
    sampling: Sampling,
    *,
    max_batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> list[Generation]:
    """Sample `sampling.n` completions per prompt; results are prompt-major (results[i*n + j])."""
    prompts_ids = _validate(model, prompts_ids, sampling, max_batch_size)
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos and tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)

    rows = [(i, prompt) for i, prompt in enumerate(prompts_ids) for _ in range(sampling.n)]
    results: list[Generation] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(rows), max_batch_size):
                batch = rows[start : start + max_batch_size]
                results.extend(
                    _generate_batch(model, tokenizer, batch, sampling, stop_ids, generator, device)
                )
    finally:
        model.train(was_training)
    return results


def _validate(
    model: DecoderLM, prompts_ids: list[list[int]], sampling: Sampling, max_batch_size: int
) -> list[list[int]]:
    """The prompts as lists of Python ints, once they are known to be good."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
    packed = validate_prompts(prompts_ids, sampling, model.config.vocab_size, model.config.max_position_embeddings)
    return packed.as_lists(prompts_ids)


def _generate_batch(
    model: DecoderLM,
    tokenizer: Tokenizer,
    batch: list[tuple[int, list[int]]],
    sampling: Sampling,
    stop_ids: set[int],
    generator: torch.Generator,
    device: str | torch.device,
) -> list[Generation]:
    num_rows = len(batch)
    max_new = sampling.max_new_tokens
    prompt_len = max(len(prompt) for _, prompt in batch)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((num_rows, prompt_len), pad_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros(num_rows, prompt_len, dtype=torch.long)  # [B, P]
    for r, (_, prompt) in enumerate(batch):
        input_ids[r, prompt_len - len(prompt) :] = torch.tensor(prompt)
        attention_mask[r, prompt_len - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    cache = KVCache.for_model(model, batch_size=num_rows, max_len=prompt_len + max_new)
    logits = model(input_ids, attention_mask, kv_cache=cache, logits_to_keep=1)[:, -1]  # [B, V]
    out_ids = torch.zeros(num_rows, max_new, dtype=torch.long, device=device)  # [B, N]
    out_logprobs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)  # [B, N]
    lengths = [max_new] * num_rows
    finish_reasons = ["length"] * num_rows
    stop_texts: dict[int, str] = {}
    stop_id_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    live = torch.arange(num_rows, device=device)  # cache row -> batch row
    running = torch.ones(num_rows, dtype=torch.bool, device=device)  # per cache row

    for step in range(max_new):
        tokens, logprobs = _sample(logits.float(), sampling, generator)  # [b], [b]
        live_running = live[running]
        out_ids[live_running, step] = tokens[running]
        out_logprobs[live_running, step] = logprobs[running]
        finished = running & torch.isin(tokens, stop_id_tensor)  # [b]
        if sampling.stop:
            finished |= _stop_string_hits(tokenizer, sampling.stop, out_ids, live, running, step, stop_texts)
        for r in live[finished].tolist():
            lengths[r] = step + 1
            finish_reasons[r] = "stop"
        running &= ~finished
        num_running = int(running.sum())
        if num_running == 0 or step == max_new - 1:
            break
        if num_running <= _COMPACT_FRACTION * len(live):
            keep = running.nonzero().squeeze(1)
            cache.select_rows(keep)
            live, tokens, running = live[keep], tokens[keep], running[keep]
        logits = model(tokens[:, None], kv_cache=cache, logits_to_keep=1)[:, -1]  # [b, V]

    out_ids_list, out_logprobs_list = out_ids.tolist(), out_logprobs.tolist()
    results = []
    for r, (prompt_index, prompt) in enumerate(batch):
        ids = out_ids_list[r][: lengths[r]]
        text = stop_texts[r] if r in stop_texts else tokenizer.decode(ids, skip_special_tokens=True)
        results.append(
            Generation(
                prompt_index=prompt_index,
                prompt_ids=list(prompt),
                output_ids=ids,
                text=text,
                logprobs=out_logprobs_list[r][: lengths[r]],
                finish_reason=finish_reasons[r],
            )
        )
    return results


def _sample(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [b] from float32 logits [b, V], and their raw-distribution logprobs [b]."""
    logprobs_all = torch.log_softmax(logits, dim=-1)  # [b, V]
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        if 0 < sampling.top_k < scaled.shape[-1]:
            kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]  # [b, 1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if sampling.top_p < 1:
            scaled = _top_p_filter(scaled, sampling.top_p)
        probs = torch.softmax(scaled, dim=-1)  # [b, V]
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [b, V]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [b, V]
    drop_sorted = mass_before >= top_p  # the top token has mass_before 0 and always stays
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def _stop_string_hits(
    tokenizer: Tokenizer,
    stops: tuple[str, ...],
    out_ids: torch.Tensor,  # [B, N] per batch row
    live: torch.Tensor,  # [b] cache row -> batch row
    running: torch.Tensor,  # [b] bool
    step: int,
    stop_texts: dict[int, str],
) -> torch.Tensor:
    """Bool [b]: running rows whose text now contains a stop string; records their cut text.

    Every step is checked, so an occurrence found now was completed by this step's token.
    """
    hits = torch.zeros_like(running)
    cache_rows = running.nonzero().squeeze(1).tolist()
    if not cache_rows:
        return hits
    batch_rows = live[cache_rows].tolist()
    texts = tokenizer.decode_batch(out_ids[batch_rows, : step + 1].tolist())
    for cache_row, batch_row, text in zip(cache_rows, batch_rows, texts):
        ends = [text.find(s) + len(s) for s in stops if s in text]
        if ends:
            stop_texts[batch_row] = text[: min(ends)]
            hits[cache_row] = True
    return hits
