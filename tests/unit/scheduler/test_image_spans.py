"""Images in the scheduler's prefix cache: blocks holding an image's placeholder tokens are keyed by
the image's content hash, so a different image behind the same tokens shares none of them, while
the text blocks before the first image are shared as without images; a bad span is refused."""

from __future__ import annotations

import hashlib

from libs.kvstore.block_hash import hash_blocks
from libs.protocol.messages import ImageSpan, SamplingParams
from services.scheduler.placement import bad_image_spans
from services.scheduler.sequence import Sequence
from tests.unit.scheduler.driver import Driver
from tests.unit.scheduler.fake_worker import EOS
from tests.unit.scheduler.test_prefix_caching import PREFIX, make_scheduler, serve

IMAGE_ID = 7  # the placeholder token: the same id for every image


def image(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def image_seq(seq_id: str, mm_hash: bytes, text: list[int] = PREFIX) -> Sequence:
    """PREFIX (two blocks of 4), a 6-token image (blocks 2 and 3), then two text tokens."""
    prompt = [*text, *[IMAGE_ID] * 6, 1, 2]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    spans = (ImageSpan(mm_hash, len(text), 6),)
    return Sequence(seq_id, "gw", prompt, params, EOS, image_spans=spans)


def test_the_same_image_hits_and_another_shares_only_the_text_before_it() -> None:
    driver = Driver(make_scheduler(), events=False)
    assert serve(driver, image_seq("a", image("cat"))).num_computed_tokens == 0
    assert serve(driver, image_seq("b", image("cat"))).num_computed_tokens == 12  # all full blocks
    other = serve(driver, image_seq("c", image("dog")))
    assert other.num_computed_tokens == 8  # PREFIX only: no block holding the image is shared
    assert other.image_spans == (ImageSpan(image("dog"), 8, 6),)  # the worker is told the image
    driver.sched.check_integrity()


def test_block_hashes_commit_to_the_content_and_where_it_sits() -> None:
    tokens = [*PREFIX, *[IMAGE_ID] * 8]
    plain = hash_blocks(tokens, 4, "fp")
    cat = hash_blocks(tokens, 4, "fp", spans=[ImageSpan(image("cat"), 8, 8)])
    dog = hash_blocks(tokens, 4, "fp", spans=[ImageSpan(image("dog"), 8, 8)])
    shifted = hash_blocks(tokens, 4, "fp", spans=[ImageSpan(image("cat"), 9, 7)])
    assert cat[:2] == plain[:2] == dog[:2]  # the text before the image hashes as without it
    assert len({cat[2], dog[2], plain[2], shifted[2]}) == 4
    # growing a chain block by block (as the scheduler does) gives the same hashes
    spans = [ImageSpan(image("cat"), 8, 8)]
    head = hash_blocks(tokens[:8], 4, "fp", spans=spans)
    tail = hash_blocks(tokens[8:], 4, "fp", parent=head[-1], spans=spans, first_position=8)
    assert head + tail == cat


def test_malformed_spans_are_refused() -> None:
    good = (ImageSpan(image("a"), 2, 4), ImageSpan(image("b"), 6, 4))
    assert bad_image_spans(good, 12) == ""
    assert "past the prompt" in bad_image_spans(good, 9)
    assert bad_image_spans((ImageSpan(b"short", 0, 4),), 12)
    assert bad_image_spans((ImageSpan(image("a"), 4, 4), ImageSpan(image("b"), 6, 2)), 12)  # overlap
    assert bad_image_spans((ImageSpan(image("a"), 0, 0),), 12)  # empty
