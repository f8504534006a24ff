"""Malformed protocol messages for a rollout worker: a seeded, deterministic generator, and a sender that fires them
from raw ZeroMQ DEALER sockets and counts what was answered.

`fuzz_cases(count, seed)` yields `FuzzCase`s (`fuzz_messages` only their frames: a msgpack header frame, sometimes
followed by raw frames). Case i of a seed is the same whatever `count` is, so `(seed, index)` names a case exactly
(`fuzz_case(seed, index)` rebuilds it). The cases cycle through every message type of
`rollout.protocol.MESSAGE_TYPES` (requests mostly, but also the worker's own reply types sent to it) and
every field of each (nested TensorSpec / TensorPiece / Completion fields, every `sampling` key of a generate, every
`dist` key of a weights_begin), putting there:

- values of the wrong type: list, map, bytes, nil, bool, float, NaN/inf, ints beyond int64 (up to 2**64 - 1, the
  largest msgpack holds), negative ints, msgpack ext values; unhashable values (lists and maps) where a string,
  an int or a dict key is expected;
- valid but hostile values: n = 0 / 10**9, negative or huge ids, nonces and versions, timeout_s of an hour,
  1e308, inf or NaN, token ids outside the vocabulary, prompts longer than the context, weights_begin naming
  tensors the model does not have (or absurd shapes and dtypes), dist pointing at odd hosts and ports;
- missing fields and unknown fields;

plus whole-message damage: a wrong or missing protocol version, an unknown / non-string / unhashable `type`,
headers that are not maps (lists, ints, strings), random bytes, truncated msgpack, invalid UTF-8 in a string,
non-string and duplicate map keys, values nested up to and past msgpack's depth limit, oversized values (strings,
lists and maps of 10**5 to 10**6 items, lists of 10**4 to 10**5 valid nested maps; at most 2 MB each and rare) and
raw data frames after a message that takes none. Every weights_begin the codec accepts names a tensor the model
lacks (or none at all, without `partial`), so no case opens a weight update. Within 4 * len(all_targets()) cases
(about 620) every (type, field) pair has had a wrong-typed and a hostile value.

`send_fuzz(address, count, seed)` sends the cases, each followed by a sentinel `ping` whose `pong` marks where the
worker's answers to that case end (the worker answers in order), so every reply is attributed to its case; a
request the worker accepts (a valid generate) is answered later by its group_result, matched by group id (a cancel
of such a group by that group's result too); the worker's unsolicited pongs (liveness probes) answer no case. The
socket (hence the client identity the worker sees) is replaced every `rotate_every` cases. Replies are awaited with
a bounded wait; when none comes the worker is probed, and a worker that stopped answering ends the run with the
cases in flight named as suspects. The `FuzzReport` counts sent / answered / error replies / unanswered, the slow
cases, and whether the worker still serves (a raw `hello`, a greedy `generate` through `RolloutClient`, and the
weight-update slot still free).

Files:

- `values.py`: the message types fuzzed, the sentinel nonces, the kinds of case and how often each comes, the
  wrong-typed and hostile values, oversized and deeply nested values, and packing a header with raw msgpack spliced in.
- `fields.py`: every (message type, field path) target, the fields' annotations, a valid baseline message of each
  type, putting a value at a field path, and whether a value fits a field.
- `cases.py`: `FuzzCase`, and what answer the worker owes it (classified with the real codec).
- `generation.py`: `fuzz_cases` / `fuzz_messages` / `fuzz_case`, building each case from its seed and index.
- `report.py`: `FuzzReport` (what `send_fuzz` saw) and `format_report`.
- `tracking.py`: the DEALER sockets and the cases in flight on them; attributing every reply to its case, stalls,
  retired sockets, liveness pings.
- `sending.py`: `send_fuzz`.
- `serving.py`: `check_serving` (hello, a greedy generate, the weight-update slot) after a fuzz.
"""

from rollout.benchmarks.fuzz.cases import FuzzCase
from rollout.benchmarks.fuzz.fields import EXTRA_FIELD, UNKNOWN_TENSOR, all_targets
from rollout.benchmarks.fuzz.generation import fuzz_case, fuzz_cases, fuzz_messages
from rollout.benchmarks.fuzz.report import FuzzReport, format_report
from rollout.benchmarks.fuzz.sending import send_fuzz
from rollout.benchmarks.fuzz.serving import GREEDY_PROMPT, GREEDY_SAMPLING, check_serving
from rollout.benchmarks.fuzz.values import (
    CATEGORIES,
    HOSTILE_BY_NAME,
    HOSTILE_FLOATS,
    HOSTILE_INT_LISTS,
    HOSTILE_INTS,
    HOSTILE_SAMPLING,
    HOSTILE_STRINGS,
    INF,
    NAN,
    NESTING_DEPTHS,
    OVERSIZED_ITEMS,
    REQUEST_TYPES,
    SENTINEL_BASE,
    WORKER_TYPES,
    WRONG_TYPE_VALUES,
)

__all__ = [
    "CATEGORIES",
    "EXTRA_FIELD",
    "GREEDY_PROMPT",
    "GREEDY_SAMPLING",
    "HOSTILE_BY_NAME",
    "HOSTILE_FLOATS",
    "HOSTILE_INTS",
    "HOSTILE_INT_LISTS",
    "HOSTILE_SAMPLING",
    "HOSTILE_STRINGS",
    "INF",
    "NAN",
    "NESTING_DEPTHS",
    "OVERSIZED_ITEMS",
    "REQUEST_TYPES",
    "SENTINEL_BASE",
    "UNKNOWN_TENSOR",
    "WORKER_TYPES",
    "WRONG_TYPE_VALUES",
    "FuzzCase",
    "FuzzReport",
    "all_targets",
    "check_serving",
    "format_report",
    "fuzz_case",
    "fuzz_cases",
    "fuzz_messages",
    "send_fuzz",
]
