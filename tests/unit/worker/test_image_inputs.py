"""Image rows in the real ModelRunner (tiny random LLaVA language model, fp32): a prompt's image
embeddings come from the media store by content hash and replace its placeholder tokens' wherever
a prefill chunk reaches them, in one chunk or cut across several; a sequence whose encoder output is
missing or misshapen fails alone, and the rest of the batch gets the tokens it gets alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from libs.kvstore.media_store import EMBEDS_TENSOR, MediaStore, image_hash
from libs.models.llama import LlamaForCausalLM
from libs.models.llava_loader import load_llava_language
from libs.models.tiny_llava import write_tiny_llava
from libs.protocol.codec import pack_tokens, unpack_tokens
from libs.protocol.messages import ImageSpan, NewSequence, SamplingParams, SchedulerOutput
from services.worker.forward_executor import ModelShape
from services.worker.image_inputs import ImageInputs
from services.worker.model_runner import ModelRunner
from tests.reference import GrowingCache

BLOCK_SIZE = 4
FINGERPRINT = "tiny-llava"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TEXT = [1, 2, 3, 4, 5]  # then the image's 6 tokens (positions 5-10: blocks 1 and 2), then 2 more


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    return load_llava_language(write_tiny_llava(tmp_path_factory.mktemp("llava")))


def stored(store: MediaStore, name: str, embeds: torch.Tensor) -> bytes:
    mm_hash = image_hash(name.encode())
    store.put_embeds(FINGERPRINT, mm_hash, save_safetensors({EMBEDS_TENSOR: embeds.contiguous()}))
    return mm_hash


def runner_for(model: LlamaForCausalLM, store: MediaStore) -> ModelRunner:
    images = ImageInputs(store, FINGERPRINT, model.config.hidden_size, torch.float32, torch.device("cpu"))
    return ModelRunner(model, ModelShape.of(model.config), 64, BLOCK_SIZE, torch.float32, images=images)


def image_prompt(image_token_id: int) -> list[int]:
    return [*TEXT, *[image_token_id] * 6, 7, 8]


def new_seq(
    seq_id: str, prompt: list[int], first_block: int, spans: tuple[ImageSpan, ...], n: int
) -> NewSequence:
    blocks = pack_tokens(list(range(first_block, first_block + 4)))
    return NewSequence(seq_id, pack_tokens(prompt), b"", GREEDY, (), blocks, 0, n, image_spans=spans)


def reference_token(model: LlamaForCausalLM, prompt: list[int], span: ImageSpan, embeds: torch.Tensor) -> int:
    rows = torch.arange(span.offset, span.end)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), GrowingCache(), rows, embeds)
    return int(model.compute_logits(hidden[-1:]).argmax())


@pytest.mark.parametrize("chunks", [[13], [7, 6], [3, 4, 4, 2]], ids=["whole", "two", "four"])
def test_image_rows_replace_the_placeholders_in_any_chunking(
    model: LlamaForCausalLM, tmp_path: Path, chunks: list[int]
) -> None:
    store = MediaStore(tmp_path)
    embeds = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    prompt = image_prompt(model.config.vocab_size - 1)
    span = ImageSpan(stored(store, "cat", embeds), len(TEXT), 6)
    runner = runner_for(model, store)
    result = runner.execute(SchedulerOutput(1, (new_seq("a", prompt, 0, (span,), chunks[0]),)))
    for step, n in enumerate(chunks[1:], start=2):
        assert result.seq_ids == ()  # no sample before the prompt's last chunk
        plan = SchedulerOutput(
            step, seq_ids=("a",), num_scheduled_tokens=pack_tokens([n]), new_block_ids=(b"",)
        )
        result = runner.execute(plan)
        runner.check_integrity()
    assert unpack_tokens(result.sampled_token_ids) == [reference_token(model, prompt, span, embeds)]
    # and the image matters: without its rows the placeholders' own embeddings give another token
    plain = model(torch.tensor(prompt), torch.arange(len(prompt)), GrowingCache())
    assert int(model.compute_logits(plain[-1:]).argmax()) != unpack_tokens(result.sampled_token_ids)[0]
    decode = SchedulerOutput(9, seq_ids=("a",), num_scheduled_tokens=pack_tokens([1]), new_block_ids=(b"",))
    runner.execute(decode)
    assert runner.seqs["a"].image_embeds == {}  # computed past the image: not held any more


def test_a_missing_or_misshapen_output_fails_its_sequence_alone(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    store = MediaStore(tmp_path)
    hidden = model.config.hidden_size
    prompt = image_prompt(model.config.vocab_size - 1)
    good = ImageSpan(stored(store, "good", torch.randn(6, hidden)), len(TEXT), 6)
    short = ImageSpan(stored(store, "short", torch.randn(5, hidden)), len(TEXT), 6)  # 5 rows, not 6
    missing = ImageSpan(image_hash(b"never encoded"), len(TEXT), 6)
    alone = runner_for(model, store).execute(SchedulerOutput(1, (new_seq("good", prompt, 0, (good,), 13),)))
    runner = runner_for(model, store)
    plan = SchedulerOutput(
        1,
        (
            new_seq("missing", prompt, 0, (missing,), 13),
            new_seq("good", prompt, 4, (good,), 13),
            new_seq("short", prompt, 8, (short,), 13),
        ),
    )
    result = runner.execute(plan)
    assert result.seq_ids == ("good",) and result.sampled_token_ids == alone.sampled_token_ids
    errors = dict(zip(result.failed_seq_ids, result.failed_errors, strict=True))
    assert set(errors) == {"missing", "short"}
    assert "not in the media store" in errors["missing"] and "expected (6," in errors["short"]
    runner.check_integrity()
    # a step of nothing but such rows (n > 1 choices of one request) fails them, not the step
    runner = runner_for(model, store)
    choices = tuple(new_seq(f"missing-{i}", prompt, 4 * i, (missing,), 13) for i in range(3))
    result = runner.execute(SchedulerOutput(1, choices))
    assert set(result.failed_seq_ids) == {"missing-0", "missing-1", "missing-2"} and not runner.seqs


def test_a_worker_without_images_refuses_image_spans(model: LlamaForCausalLM, tmp_path: Path) -> None:
    runner = ModelRunner(model, ModelShape.of(model.config), 64, BLOCK_SIZE, torch.float32)
    span = ImageSpan(image_hash(b"x"), len(TEXT), 6)
    result = runner.execute(SchedulerOutput(1, (new_seq("a", image_prompt(5), 0, (span,), 13),)))
    assert result.failed_seq_ids == ("a",) and "takes no images" in result.failed_errors[0]
