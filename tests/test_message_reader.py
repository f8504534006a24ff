"""`MessageReader` over a real ZeroMQ ROUTER socket: a message of many frames is read a bounded number of frames per
call (a weight bucket of 65,536 pieces used to be read in one call: a quarter of a second in which no other client
was served), kept whole when it is within the limits, and cut (its header kept, the rest dropped) when it is not."""

from __future__ import annotations

import time

import pytest
import zmq

from rollout.protocol.sockets import MessageReader

FRAMES_PER_READ = 100


@pytest.fixture
def pair():
    """A ROUTER socket and a DEALER connected to it, in process."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind("inproc://reader")
    dealer.connect("inproc://reader")
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()


def read_all(reader: MessageReader, router: zmq.Socket) -> tuple[object, int, list[bool]]:
    """Call `read` until a message comes back; returns it, the number of calls, and `busy` after each empty call."""
    router.poll(5000)
    busy_after: list[bool] = []
    for calls in range(1, 10_000):
        message = reader.read()
        if message is not None:
            return message, calls, busy_after
        busy_after.append(reader.busy)
        if not reader.busy:
            time.sleep(0.001)
    raise AssertionError("no message came back")


def test_a_message_of_many_frames_is_read_over_several_calls_and_kept_whole(pair):
    router, dealer = pair
    reader = MessageReader(router, max_frames=1000, max_bytes=1 << 20, frames_per_read=FRAMES_PER_READ)
    frames = [b"header"] + [index.to_bytes(2, "little") for index in range(950)]
    dealer.send_multipart(frames)
    message, calls, busy_after = read_all(reader, router)
    assert message.refused is None and [bytes(frame.bytes) for frame in message.frames] == frames
    assert calls == len(frames) // FRAMES_PER_READ + 1 and all(busy_after) and not reader.busy
    dealer.send_multipart([b"next"])  # the reader is ready for the next message
    message, calls, _ = read_all(reader, router)
    assert [frame.bytes for frame in message.frames] == [b"next"] and calls == 1


@pytest.mark.parametrize("limit", ["frames", "bytes"])
def test_a_message_past_the_limits_is_cut_to_its_header_and_drained_over_several_calls(pair, limit):
    router, dealer = pair
    max_frames, max_bytes = (300, 1 << 20) if limit == "frames" else (10_000, 2_000)
    reader = MessageReader(router, max_frames=max_frames, max_bytes=max_bytes, frames_per_read=FRAMES_PER_READ)
    dealer.send_multipart([b"header"] + [b"0123456789"] * 950)
    dealer.send_multipart([b"after"])
    message, calls, busy_after = read_all(reader, router)
    assert [frame.bytes for frame in message.frames] == [b"header"]
    expected = f"more than {max_frames} frames" if limit == "frames" else f"more than {max_bytes} bytes"
    assert expected in message.refused
    assert calls == 951 // FRAMES_PER_READ + 1 and all(busy_after)
    message, _, _ = read_all(reader, router)  # nothing of the cut message is left behind
    assert [frame.bytes for frame in message.frames] == [b"after"] and message.refused is None


def test_a_header_is_bounded_apart_from_the_data_after_it(pair):
    """With max_header_bytes, max_bytes bounds the data frames alone (the worker's --max-message-bytes: a 1 MiB
    limit let 11.5 MB of weight frames through beside the header's own 32 MiB allowance)."""
    router, dealer = pair
    reader = MessageReader(
        router, max_frames=1000, max_bytes=2_000, frames_per_read=FRAMES_PER_READ, max_header_bytes=50
    )
    dealer.send_multipart([b"h" * 40] + [b"0123456789"] * 200)  # data: exactly the limit
    message, _, _ = read_all(reader, router)
    assert message.refused is None and len(message.frames) == 201
    dealer.send_multipart([b"h" * 40] + [b"0123456789"] * 201)  # data: one frame past it
    message, _, _ = read_all(reader, router)
    assert "more than 2000 bytes of data" in message.refused and len(message.frames) == 1
    dealer.send_multipart([b"h" * 51, b"x"])
    message, _, _ = read_all(reader, router)
    assert "a header of more than 50 bytes" in message.refused
