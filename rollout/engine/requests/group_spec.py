"""`GroupSpec`: one group as a caller asks for it, before the intake checks it. Every way in (the manager's
`add_request` / `add_groups`, `Engine.add_request`, colocated rounds) builds one, and `RequestIntake.prepare` turns
it into the group's leader `Request`: the request's settings are listed once, here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.config import SamplingParams


@dataclass(frozen=True)
class GroupSpec:
    """A group of `n` samples of one prompt, as asked for (unchecked: `RequestIntake.prepare` checks every field).

    Attributes:
        group_id: unique id of the group (must not be running already).
        prompt_ids: prompt token ids (a list, or a 1-D / (1, L) tensor or array).
        sampling: sampling parameters (None fields come from the generation config).
        n: samples in the group (None: the GenerationConfig's num_return_sequences, else 1); sample i is seeded
            from (seed, i).
        max_new_tokens: the length (refused when `sampling.max_new_tokens` gives another).
        streaming: emit a delta after every token (else one output per sample when it finishes).
        record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
        adapter: the LoRA adapter to sample with; None: the base model.
        client: who sent the group (the worker names each connection; "" for in-process callers): admission takes
            turns between clients, and speculative decoding proposes drafts only from the samples of groups of the
            same client, session, prompt and adapter.
        session: a secret the client drew (the wire's `Generate.session`; "" for none): drafts are shared only
            among groups of one client and one session (a connection that took over a gone client's routing id
            draws on none of its drafts). Admission turns are the client's, whatever its sessions.
    """

    group_id: str
    prompt_ids: Any
    sampling: SamplingParams | None = None
    n: int | None = None
    max_new_tokens: int | None = None
    streaming: bool = False
    record_timestamps: bool = False
    adapter: str | None = None
    client: str = ""
    session: str = ""
