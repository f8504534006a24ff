"""The wire protocol between trainers and rollout workers: every message is a dataclass, one codec turns it into
bytes. `trainer_bridge` imports this module and `rollout.protocol.sockets` (nothing else from `rollout`).

Transport: ZeroMQ multipart messages. A worker binds a ROUTER socket; clients connect DEALER sockets (the ROUTER
adds and strips the client's identity frame). Frame 0 of every message is a msgpack map, the header:

    {"protocol": 3, "type": "<message type>", <the message's fields>}

The codec writes "protocol" and "type" first and each message's id field (group_id or update_id) next: a worker
reads them alone (`header_glance`) to refuse a message its sender's role may not send before decoding it.
Frames after the header carry raw tensor bytes (weight updates only), described by the header, never pickled.
Decoding checks the protocol version, the type, and every field's presence and type; anything wrong raises
`ProtocolError`, whose `field` names the culprit ("header" for undecodable bytes), and the worker answers with an
`Error` message carrying that field.

Messages (client -> worker, then what the worker answers):

| type           | fields                                                               | answer                          |
|----------------|----------------------------------------------------------------------|---------------------------------|
| hello          | -                                                                    | hello_reply                     |
| generate       | group_id: str, prompt_ids: [int], n: int = 1, sampling: {str: any} = | delta* (stream only), then      |
|                | {}, stream: bool = false, adapter: str or nil (a served LoRA adapter | group_result; or error          |
|                | to sample with; nil: the base model), session: str = "" (a secret    |                                 |
|                | the client draws once, at most 64 characters: speculative drafts are |                                 |
|                | shared only among its groups of that session)                        |                                 |
| cancel         | group_id: str                                                        | group_result (abort) or error   |
| ping           | nonce: int = 0                                                       | pong                            |
| stats          | -                                                                    | stats_reply                     |
| weights_spec   | update_id: str                                                       | weights_spec_reply              |
| weights_begin  | update_id: str, tensors: [TensorSpec], version: int or nil, mode:    | weights_ready, or error         |
|                | str = "keep", transport: str = "frames", partial: bool = false,      |                                 |
|                | timeout_s: float = 60, dist: {str: any} = {}, preempt: bool = false, |                                 |
|                | adapter: str or nil (a LoRA adapter's update), scalings: {str:       |                                 |
|                | float} = {}, base_id: str or nil (the base weights it is for)        |                                 |
| weights_bucket | update_id: str, pieces: [TensorPiece], checksum: int or nil (nil is  | weights_ack, or error (the      |
|                | refused over transport "shm"); + one raw frame per piece (transport  | update is then dropped)         |
|                | "frames")                                                            |                                 |
| weights_commit | update_id: str                                                       | weights_committed, or error     |
| weights_abort  | update_id: str                                                       | weights_ack (state "aborted"),  |
|                |                                                                      | or error (unknown_update,       |
|                |                                                                      | update_committing)              |
| adapter_unload | update_id: str (any id: the answer carries it), adapter: str (a      | adapter_unloaded, or error      |
|                | served LoRA adapter: its groups end with finish_reason "abort")      | ("bad_request", field adapter)  |

Worker -> client:

| type               | fields                                                                                     |
|--------------------|--------------------------------------------------------------------------------------------|
| hello_reply        | model: str, vocab_size: int, max_model_len: int, policy_version: int, config: {str: any},  |
|                    | tokenizer: str or nil (where the worker's tokenizer came from; nil: none, no stop strings) |
| delta              | group_id: str, sample_index: int, token_ids: [int], logprobs: [float], policy_version: int |
|                    | and routes / prompt_routes, top log-probs and prompt log-probs as a Completion's (below)   |
| group_result       | group_id: str, prompt_ids: [int], completions: [Completion as a map]                       |
| pong               | nonce: int, policy_version: int                                                            |
| stats_reply        | stats: {str: any} (policy_version, weight_updates, last_weight_update_at, queue, KV, ...)  |
| weights_spec_reply | update_id: str, tensors: [TensorSpec], policy_version: int, base_id: str or nil,           |
|                    | adapters: {str: int} (served LoRA adapters and their versions), base_aliases: [str] (other |
|                    | names of the same base, bit for bit: an adapter update naming one needs no base)           |
| weights_ready      | update_id: str, staging_bytes: int, shm_name: str or nil                                   |
| weights_ack        | update_id: str, received_bytes: int, state: "staging" or "aborted"                         |
| weights_committed  | update_id: str, version: int, pause_ms: float, copy_ms: float, drain_ms: float,            |
|                    | aborted: int, recomputed: int                                                              |
| adapter_unloaded   | update_id: str, adapter: str, aborted: int (its samples that ended with "abort")           |
| error              | code: str, message: str, field: str or nil, group_id: str or nil, update_id: str or nil    |

Liveness: a worker cancels the groups of a client that has groups in flight and has sent nothing for its
`--client-timeout` (30 s by default), so a client waiting on long groups should send `ping` every few seconds. A
client whose connection closed, or that leaves more than `--max-pending-bytes` of replies unread (or the most of
them, when all clients' unread replies pass 4 times that), is dropped at once (groups cancelled). To find out whether a connection that closed was a client's, the worker may send it an
unsolicited `pong` with nonce -1 (`PROBE_NONCE`): clients ignore pongs they did not ask for.

Limits (`rollout-worker --max-...`, answered by name): header lists hold at most 2**20 items, maps 2**16 entries,
strings 2**20 bytes (longer ones are refused before they are built), and a header at most 2**17 lists and maps in
all and 32 MiB (64 KiB for ping, stats, hello, cancel, weights_spec, weights_commit, weights_abort and adapter_unload); a
group_id or update_id at most 1024 characters; a prompt is at most `--max-prompt-len` tokens (checked from its length first); `n` at most
`--max-n`; at most `--max-groups-per-client` groups in flight ("busy" past it); frames at most
`--max-message-bytes` (a larger one drops the connection), and a message's frames after its header as much
together.

Security: with `--curve-secret-key` every connection is CurveZMQ-encrypted and only listed keys connect; weight
updates (weights_begin/bucket/commit/abort) and adapter_unload need a key of `--trainer-keys`, others get "unauthorized".

A Completion map: sample_index: int, token_ids: [int], logprobs: [float], finish_reason: "stop" | "length" |
"abort" | "error", error: str or nil, policy_versions: [[version, index of the first token it sampled], ...]
(run-length encoded), kv_version_min: int (the oldest weights' version behind the sample's KV when it finished, or
behind KV it held before that newer weights sampled its tokens over), adapter / adapter_version,
cached_prompt_tokens: int (prompt tokens whose KV came from the prefix cache), and with sampling.return_routes (MoE
models) routes / prompt_routes: FrameArray maps (frame: index of a raw frame after the header, shape: [rows, MoE
layers, top_k], dtype: "uint8" or "int16"); with sampling.top_logprobs = k, top_token_ids / top_logprobs:
FrameArray maps of shape [tokens, k] ("int32" ids, most likely first; "float32" log-probs; id -1 and NaN pad a
distribution of fewer than k tokens); with sampling.prompt_logprobs = k, FrameArray maps with a row per prompt
position after the first (row i: position i + 1): prompt_logprobs ("float32", shape [prompt_len - 1]),
prompt_logprob_ranks ("int32", 1 the most likely) and for k > 0 prompt_top_token_ids / prompt_top_logprobs
([prompt_len - 1, k]); the completions of a group_result name the same frames. A delta carries its tokens' routes
and top log-probs (and the prompt's, on a sample's first delta) the same way. `sampling` takes the field names of
`rollout.SamplingParams`.

Weight updates are transactions, one open at a time per worker: weights_begin announces every tensor (TensorSpec
map: name, dtype such as "bfloat16", shape) and is checked against the model at once (unknown or missing names,
wrong dtypes or shapes, a version not above the current one are refused, `field` naming the tensor or setting);
buckets carry TensorPiece maps (index: announced tensor, offset and nbytes: a byte range of it; each tensor's pieces
in order, without gaps), at most 4 of them waiting for their weights_ack at a time (a fifth drops the update: its
one error answers for the buckets still waiting too); weights_commit checks that every announced byte arrived, then the engine copies the update
into the model in place between two steps. The staging area lays the tensors out in order, each at an offset
aligned to 64 bytes (`rollout.protocol.staging.staging_layout`); over transport "shm" the client writes each bucket
into a shared-memory segment (named in weights_ready) at that layout, and the worker copies it out before checking
it; "torch.distributed" broadcasts each piece of a bucket, in order, over the process group described by `dist` (host, port: the trainer's TCPStore; world_size; rank of this
worker, >= 1; backend "gloo" or "nccl"; group: a key, reused while it does not change). Every phase must follow the
previous one within `timeout_s`; a client that misses a deadline or disappears gets its update dropped, and the old
weights keep serving. A malformed weight message naming the open update drops it (one error says why); a message
of another type that names it (a ping with an update_id) is refused alone. `mode` says what happens to in-flight samples at commit: "keep" (continue on their KV),
"recompute" (re-prefill prompt + tokens so far), "abort" (end with finish_reason "abort"), "wait" (admission pauses
until in-flight samples finish, at most `timeout_s`).

A generate whose sampling has a structured-output constraint (regex, json, choice, grammar, json_object) is compiled
off the serving loop first: its refusal (a bad spec: "bad_request" naming `sampling.<field>`) or its outputs may come
after the replies to messages sent after it; every such reply carries its group_id. So may the answer to an
adapter_unload (the engine carries it out between two steps): it carries its update_id.

Error codes: "bad_request" (a field is wrong), "busy" (the queue is full: retry later), "unknown_group",
"duplicate_group", "internal"; for weight updates: "bad_update" (`field` names the tensor or setting),
"update_timeout", "update_in_progress", "update_committing", "update_preempted", "unknown_update", "base_mismatch"
(a LoRA adapter meant for another base); "unauthorized"
(the client's key may not do this: weight updates and adapter unloads need a trainer key).
"""

from rollout.protocol.message_base import (
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_HEADER_CONTAINERS,
    MAX_HEADER_ITEMS,
    MAX_HEADER_STR,
    PROBE_NONCE,
    PROTOCOL_VERSION,
    ClientMessage,
    Message,
    ProtocolError,
    WorkerMessage,
)
from rollout.protocol.messages import (
    MESSAGE_TYPES,
    REQUEST_TYPES,
    Cancel,
    Completion,
    Delta,
    Error,
    FrameArray,
    Generate,
    GroupResult,
    Hello,
    HelloReply,
    Ping,
    Pong,
    SampleArrays,
    Stats,
    StatsReply,
)
from rollout.protocol.transports import WEIGHT_TRANSPORTS
from rollout.protocol.weight_messages import (
    AdapterUnload,
    AdapterUnloaded,
    TensorPiece,
    TensorSpec,
    WeightsAbort,
    WeightsAck,
    WeightsBegin,
    WeightsBucket,
    WeightsCommit,
    WeightsCommitted,
    WeightsReady,
    WeightsSpec,
    WeightsSpecReply,
)

__all__ = [
    "decode",
    "AdapterUnload",
    "AdapterUnloaded",
    "encode",
    "encode_steps",
    "Cancel",
    "ClientMessage",
    "Completion",
    "FrameArray",
    "SampleArrays",
    "Delta",
    "Error",
    "Generate",
    "GroupResult",
    "Hello",
    "HelloReply",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_CONTAINERS",
    "MAX_HEADER_ITEMS",
    "MAX_HEADER_STR",
    "MESSAGE_TYPES",
    "Message",
    "PROBE_NONCE",
    "PROTOCOL_VERSION",
    "Ping",
    "Pong",
    "ProtocolError",
    "REQUEST_TYPES",
    "WEIGHT_TRANSPORTS",
    "Stats",
    "StatsReply",
    "TensorPiece",
    "TensorSpec",
    "WeightsAbort",
    "WeightsAck",
    "WeightsBegin",
    "WeightsBucket",
    "WeightsCommit",
    "WeightsCommitted",
    "WeightsReady",
    "WeightsSpec",
    "WeightsSpecReply",
    "WorkerMessage",
]


def __getattr__(name: str):
    """`encode`, `encode_steps` and `decode` load the codec (and msgpack) on first use: `rollout.protocol.messages` alone needs
    neither (`rollout-bench` reads the transports' names before the service dependencies are installed)."""
    if name in ("encode", "encode_steps", "decode"):
        from rollout.protocol import codec

        return getattr(codec, name)
    raise AttributeError(f"module 'rollout.protocol' has no attribute {name!r}")
