"""The wire protocol: every message round-trips; malformed or mistyped input is refused naming the field."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import protocol as p

EXAMPLES = [
    p.Hello(),
    p.Generate("g1", [1, 2, 3], n=8, sampling={"temperature": 0.7, "seed": 3}, stream=True),
    p.Cancel("g1"),
    p.Ping(7),
    p.Stats(),
    p.HelloReply("tiny", 1024, 2048, 0, {"block_size": 16}),
    p.Delta("g1", 2, [5, 6], [-0.5, -1.25], 0),
    p.GroupResult("g1", [1, 2, 3], [p.Completion(0, [5, 6], [-0.5, -1.0], "length", None, [[0, 0]], 0)]),
    p.Pong(7, 3),
    p.StatsReply({"queued": 0, "tokens_per_s": 12.5}),
    p.Error("bad_request", "n: must be >= 1", "n", "g1"),
    p.WeightsSpec("u1"),
    p.WeightsSpecReply("u1", [p.TensorSpec("lm_head.weight", "bfloat16", [1024, 256])], 3),
    p.WeightsBegin("u1", [p.TensorSpec("a", "float32", [2, 3])], version=7, mode="recompute", transport="shm"),
    p.WeightsReady("u1", 64, "rollout-abc"),
    p.WeightsBucket("u1", [p.TensorPiece(0, 0, 24)]),
    p.WeightsAck("u1", 24),
    p.WeightsCommit("u1"),
    p.WeightsCommitted("u1", 7, 12.5, 10.0, 0.0, 1, 2),
    p.WeightsAbort("u1"),
    p.AdapterUnload("u2", "policy"),
    p.AdapterUnloaded("u2", "policy", 3),
    p.Error("bad_update", "a: shape [2] does not match the model's [2, 3]", "a", None, "u1"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_every_message_round_trips(message):
    assert p.decode(p.encode(message)) == message


def test_a_field_given_in_plain_form_is_sent_as_given():
    """A reply whose maker keeps a large field's codec form (`plain_fields`: weights_spec's tensors) encodes to the
    very bytes of the same reply converted field by field, and decodes back to it."""
    from rollout.protocol.codec import to_plain

    specs = [p.TensorSpec(f"model.layers.{i}.mlp.experts.{i % 7}.weight", "bfloat16", [768, i]) for i in range(300)]
    reply = p.WeightsSpecReply("u1", specs, 3, "base", {"math": 2})
    given = p.WeightsSpecReply("u1", specs, 3, "base", {"math": 2})
    given.plain_fields = {"tensors": to_plain(specs)}
    assert p.encode(given) == p.encode(reply) and p.decode(p.encode(given)) == reply
    given.plain_fields = {"tensors": to_plain(specs[:1])}  # sent as given, not converted again from the field
    assert p.decode(p.encode(given)).tensors == specs[:1]


def test_every_message_type_has_an_example():
    assert {m.TYPE for m in EXAMPLES} == set(p.MESSAGE_TYPES)


def header(**fields) -> list[bytes]:
    return [msgpack.packb({"protocol": p.PROTOCOL_VERSION, **fields}, use_bin_type=True)]


@pytest.mark.parametrize(
    "frames, field",
    [
        ([], "header"),
        ([b"\xc1not msgpack"], "header"),
        ([msgpack.packb([1, 2])], "header"),
        ([msgpack.packb({"protocol": 99, "type": "ping"})], "protocol"),
        (header(type="launch_missiles"), "type"),
        (header(type="generate", prompt_ids=[1]), "group_id"),
        (header(type="generate", group_id=5, prompt_ids=[1]), "group_id"),
        (header(type="generate", group_id="g", prompt_ids=[1, "x"]), "prompt_ids[1]"),
        (header(type="generate", group_id="g", prompt_ids=[1], n=True), "n"),
        (header(type="generate", group_id="g", prompt_ids=[1], sampling=[1]), "sampling"),
        (header(type="generate", group_id="g", prompt_ids=[1], surprise=1), "surprise"),
        (
            header(type="group_result", group_id="g", prompt_ids=[1], completions=[{"sample_index": 0}]),
            "completions[0].token_ids",
        ),
        (
            header(type="delta", group_id="g", sample_index=0, token_ids=[1], logprobs=["a"], policy_version=0),
            "logprobs[0]",
        ),
        (header(type="weights_begin", update_id="u", tensors=[{"name": "a", "dtype": "float32"}]), "tensors[0].shape"),
        (
            header(type="weights_bucket", update_id="u", pieces=[{"index": 0, "offset": "0", "nbytes": 4}]),
            "pieces[0].offset",
        ),
    ],
)
def test_malformed_messages_name_the_field(frames, field):
    with pytest.raises(p.ProtocolError) as raised:
        p.decode(frames)
    assert raised.value.field == field


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)  # tests/test_fuzz.py fires 3,000 more at a worker
@given(
    message_type=st.sampled_from(sorted(p.MESSAGE_TYPES) + ["bogus"]),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "group_id",
                "prompt_ids",
                "n",
                "sampling",
                "stream",
                "nonce",
                "token_ids",
                "logprobs",
                "completions",
                "code",
                "message",
                "x",
            ]
        ),
        _values,
        max_size=6,
    ),
)
def test_fuzzed_headers_decode_or_raise_protocol_error(message_type, fields):
    """Any header either decodes into a well-typed message or raises ProtocolError; nothing else escapes."""
    try:
        message = p.decode(header(type=message_type, **fields))
    except p.ProtocolError:
        return
    assert p.decode(p.encode(message)) == message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_protocol_error(data):
    with pytest.raises(p.ProtocolError):
        p.decode([data])


def test_a_header_of_millions_of_small_containers_is_refused_while_decoding():
    """Review finding: 200 fields of a million empty lists each passed every per-list bound and made msgpack build
    200 million lists. Maps and lists are counted together while decoding, and the header's bytes are bounded."""
    import time

    many = msgpack.packb(
        {"protocol": p.PROTOCOL_VERSION, "type": "ping", **{f"x{i}": [[]] * 100_000 for i in range(20)}}
    )
    started = time.monotonic()
    with pytest.raises(p.ProtocolError) as error:
        p.decode([many])
    assert error.value.field == "header" and "max_containers" in str(error.value)
    assert time.monotonic() - started < 5.0  # refused after 2**17 containers, not after 2 million
    with pytest.raises(p.ProtocolError, match="more than the limit"):
        p.decode(
            [msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": "ping", "x": b"\0" * (p.MAX_HEADER_BYTES + 1)})]
        )


def test_a_map_of_more_keys_than_any_message_has_is_refused_unread():
    """An audit finding: a sampling map of a million keys fit the header's bytes and took over half a second to
    decode on the serving thread. One map holds at most MAX_HEADER_MAP_ITEMS entries, refused from its length;
    lists keep their larger bound (a prompt's tokens)."""
    from rollout.protocol.message_base import MAX_HEADER_MAP_ITEMS

    wide = {f"k{i}": 1 for i in range(MAX_HEADER_MAP_ITEMS + 1)}
    for header in ({"sampling": wide}, {"sampling": {"logit_bias": wide}}):
        frames = [msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": "generate", "group_id": "g", **header})]
        with pytest.raises(p.ProtocolError, match="over the limit") as error:
            p.decode(frames)
        assert error.value.field == "header"
    long_prompt = p.Generate("g", list(range(MAX_HEADER_MAP_ITEMS * 2)))
    assert p.decode(p.encode(long_prompt)) == long_prompt


def test_a_refused_message_still_names_its_ids():
    """The ids of a malformed message travel on the ProtocolError, so the worker routes its error reply without
    decoding the header a second time."""
    with pytest.raises(p.ProtocolError) as error:
        p.decode(
            [msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": "generate", "group_id": "g7", "prompt_ids": "x"})]
        )
    assert (error.value.field, error.value.group_id, error.value.update_id) == ("prompt_ids", "g7", None)


@pytest.mark.parametrize("message", [m for m in EXAMPLES if isinstance(m, p.ClientMessage)], ids=lambda m: m.TYPE)
def test_a_glance_finds_the_type_and_ids_that_decoding_finds(message):
    """What a worker reads of a header before deciding to decode it (a role's refusal, a message cut for its size):
    the type and ids of every request the codec writes, the same as the full decode's."""
    from rollout.protocol.header_glance import glance

    seen = glance(p.encode(message)[0])
    assert seen.get("type") == message.TYPE
    assert seen.get("group_id") == getattr(message, "group_id", None)
    assert seen.get("update_id") == getattr(message, "update_id", None)


def test_a_glance_reads_a_few_kilobytes_of_a_large_header_and_takes_the_first_of_each_key():
    """A weights_begin naming 20,000 tensors (1.5 MB), or a header whose first value is a 30 MB string: the glance
    takes in at most GLANCE_BYTES of it (msgpack would buffer a whole string before its length check). An id longer
    than the glance reads leaves the header to the decode (`glance_ids` is None), which refuses it naming it. A header with a
    second "type" (msgpack maps may repeat keys; decoding keeps the last) shows the glance its first: the worker
    checks the decoded type's role again. What is no msgpack map, or is cut short, gives what was found before."""
    import tracemalloc

    from rollout.protocol.header_glance import GLANCE_BYTES, glance, glance_ids

    tensors = [p.TensorSpec(f"model.layers.{i}.mlp.up_proj.weight", "bfloat16", [4096, 4096]) for i in range(20_000)]
    header = p.encode(p.WeightsBegin("u9", tensors))[0]
    long_first = msgpack.packb({"x": "y" * (30 << 20), "protocol": p.PROTOCOL_VERSION, "type": "weights_begin"})
    tracemalloc.start()
    try:
        assert glance(header) == {"type": "weights_begin", "update_id": "u9"}
        assert glance(long_first) == {}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * GLANCE_BYTES

    long_id = p.encode(p.WeightsBegin("u" * GLANCE_BYTES, tensors[:2]))[0]
    assert glance(long_id) == {"type": "weights_begin"} and glance_ids(long_id) is None
    with pytest.raises(p.ProtocolError, match="more than the limit of 1024") as refused:  # and the decode names it
        p.decode([long_id])
    assert refused.value.update_id == "u" * GLANCE_BYTES
    assert glance_ids(header) == {"type": "weights_begin", "update_id": "u9"}
    assert glance_ids(p.encode(p.Ping(3))[0]) == {"type": "ping"}

    packer = msgpack.Packer()
    twice = b"".join(
        [packer.pack_map_header(4), packer.pack("protocol"), packer.pack(p.PROTOCOL_VERSION)]
        + [packer.pack("type"), packer.pack("ping"), packer.pack("update_id"), packer.pack("u1")]
        + [packer.pack("type"), packer.pack("weights_commit")]
    )
    assert glance(twice) == {"type": "ping", "update_id": "u1"}
    assert p.decode([twice]).TYPE == "weights_commit"
    assert glance(b"\x93\x01\x02\x03") == {} and glance(b"") == {}
    assert glance(header[:60]) == {"type": "weights_begin", "update_id": "u9"}
    assert glance(header[:35]) == {"type": "weights_begin"} and glance_ids(header[:35]) is None
    assert glance(header[:12]) == {}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (msgpack.packb({1: 2}), "int is not allowed for map key"),
        (b"\x81\xa1\xff\x01", "a string is not valid UTF-8"),
        (b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0", "lists and maps nested too deep"),
    ],
)
def test_an_undecodable_header_says_what_is_wrong_with_it(payload, reason):
    with pytest.raises(p.ProtocolError, match=reason) as refused:
        p.decode([payload])
    assert refused.value.field == "header"


def test_an_id_too_long_for_the_small_messages_that_name_it_is_refused():
    """A group_id or update_id over 1024 characters is refused where it is first sent: a cancel or weights_commit
    naming it again must fit the 64 KiB such small messages may hold."""
    with pytest.raises(p.ProtocolError, match="more than the limit of 1024") as refused:
        p.decode(p.encode(p.Generate("g" * 1025, [1, 2])))
    assert refused.value.field == "group_id"
    assert p.decode(p.encode(p.Generate("g" * 1024, [1, 2]))).group_id == "g" * 1024
