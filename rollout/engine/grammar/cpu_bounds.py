"""How much CPU following a grammar may take: `CpuWatch`, one per sample's matcher (`constraints.Constrained`).

xgrammar's matcher state can grow with the output. Under a nested repetition (`root ::= ((("a")+)+)+`, 25
characters, compiled in a millisecond) each token's accept and mask fill cost grow with the cube of the tokens so far,
and the step of every other sample waits for them. A sample past these bounds is ended with an error at its next step
(its mask then allows nothing), and the others go on.
"""

from __future__ import annotations

# The most CPU time one token's `accept_token` may take before its sample is ended with an error. xgrammar's matcher
# state can grow with the output: under a nested repetition (`root ::= ((("a")+)+)+`, 25 characters, compiled in a
# millisecond) each token's accept and mask cost grow with the cube of the tokens so far (0.2 s a token after 300 on
# a 1,024-token vocabulary), and the step of every other sample waits for them. A JSON schema's or a regex's accept
# takes microseconds (at most 0.6 ms seen, 1,000 levels deep; 3 ms in an enum of 20,000 strings); the mask fill of
# such a row costs about twice its accept. The bound leaves a slower host 6 times that enum's cost, and ends the
# nested repetition after about 115 tokens, its fills and accepts having cost about 2 s of a core (at 50 ms: 160
# tokens and 7 s, for each sample of its group). Thread CPU time, so a loaded machine does not end a sample whose
# grammar is cheap.
MAX_ACCEPT_S = 0.02
# An accept past MAX_ACCEPT_S that is a buffer's growth, not a grammar too slow to follow: under a bounded repetition
# (`maxItems` / `minItems` of an array: 100,000 of them, or 3,000) xgrammar's matcher grows a buffer each time the
# output grows by a factor (1.4 to 2), and that one accept costs 3 to 23 us per token so far (100 ms after 32,000
# tokens), the accepts between staying in microseconds. Such an accept is let through when it costs at most
# SPIKE_S_PER_TOKEN per token generated and the output grew SPIKE_GROWTH-fold since the last one let through: the
# CPU they take stays under SPIKE_S_PER_TOKEN / (1 - 1 / SPIKE_GROWTH) per token (0.5 ms) over a sample's life.
SPIKE_S_PER_TOKEN = 100e-6
SPIKE_GROWTH = 1.25
# The most CPU time one row's min_new_tokens look-ahead (`prune_short_paths`: at most MAX_ROW_FILLS mask fills, each
# on a narrow mask, so about 0.1 ms on a large vocabulary) may take at one step: cut there, and its sample ended at
# the next step, as past MAX_ACCEPT_S. The look-ahead accepts its candidate tokens on the sample's own matcher, so it,
# not the sample's accept, pays a bounded repetition's buffer growth when one comes (95 ms at 32,500 tokens of a
# `maxItems` array): such a look-ahead is let through as such an accept is, under the same allowance.
MAX_LOOK_AHEAD_S = 0.1


class CpuWatch:
    """The CPU time one sample's grammar took: whether it is too slow to follow (`too_slow`), and why."""

    def __init__(self) -> None:
        # CPU seconds of the accept past MAX_ACCEPT_S, or look-ahead past MAX_LOOK_AHEAD_S (None: none was).
        self.too_slow: float | None = None
        self.spiked = 0  # tokens generated at the last accept or look-ahead past its bound let through as a growth

    def accepted(self, seconds: float, generated: int) -> None:
        """One token's accept took `seconds` of this thread's CPU.

        Args:
            seconds: its CPU time.
            generated: the tokens the matcher had advanced past before it.
        """
        self._took(seconds, MAX_ACCEPT_S, generated)

    def looked_ahead(self, seconds: float, generated: int) -> None:
        """One step's min_new_tokens look-ahead for the sample took `seconds` of this thread's CPU.

        Args:
            seconds: its CPU time.
            generated: the tokens the matcher had advanced past (the look-ahead tries the next one).
        """
        self._took(seconds, MAX_LOOK_AHEAD_S, generated)

    def _took(self, seconds: float, bound: float, generated: int) -> None:
        """Something of the grammar's took `seconds` where `bound` is the most it may: past it, the grammar is too
        slow to follow, unless it is a buffer's growth (SPIKE_S_PER_TOKEN), which either may pay."""
        if seconds <= bound or self.too_slow is not None:
            return
        if seconds <= SPIKE_S_PER_TOKEN * generated and generated >= SPIKE_GROWTH * self.spiked:
            self.spiked = generated  # a buffer's growth (SPIKE_S_PER_TOKEN), not a grammar too slow to follow
        else:
            self.too_slow = seconds

    def reason(self) -> str:
        """Why the sample ends (after its grammar's field name), once `too_slow`."""
        return (
            f"following the grammar took {(self.too_slow or 0.0) * 1000:.1f} ms of CPU at one step (the bound is "
            f"{MAX_ACCEPT_S * 1000:g} ms a token, {MAX_LOOK_AHEAD_S * 1000:g} ms for the min_new_tokens look-ahead): its "
            "matcher's state grows with the output, as under a nested repetition like ((x)+)+; the sample was ended so "
            "as not to stall every other sample's steps"
        )
