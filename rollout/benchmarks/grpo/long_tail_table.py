"""The table `rollout-bench long-tail` prints for one run: the workload, the cache, what was recomputed and swapped,
the running batch, the long tail's steps and the last finish over the median one."""

from __future__ import annotations

from typing import Any


def finish_line(s: dict[str, Any]) -> str:
    """The round's last finish over its median one, or why there is none (a run cut before every sample ended)."""
    if s["last_over_median_finish"] is None:
        return f"none: {s['samples_finished']} of {s['samples']} samples finished before the run stopped"
    return f"{s['last_over_median_finish']} ({s['last_finish_s']} s / {s['median_finish_s']} s)"


def tail_line(s: dict[str, Any]) -> str:
    """The tail's time per token and its steps by kind, for the table ("-" where a figure has no step)."""

    def shown(value: Any) -> str:
        return "-" if value is None else f"{value} ms"

    line = f"{shown(s['tail_ms_per_token'])} per token: {s['tail_plain_steps']} plain steps"
    line += f" of {shown(s['tail_plain_step_ms'])}" if s["tail_plain_steps"] else ""
    if s["tail_drafted_steps"]:
        line += f", {s['tail_drafted_steps']} drafted of {shown(s['tail_drafted_step_ms'])}"
    return f"{line}; {s['tail_forwards_per_token']} forwards per token"


def print_table(s: dict[str, Any]) -> None:
    """Print a run's summary as the table's rows (then the definition of recomputed tokens).

    Args:
        s: the summary `long_tail.measure` returns.
    """
    generated = s["generated_tokens"]
    rows = [
        ("workload", f"{s['prompts']} prompts x n={s['n']} ({s['model']} on {s['device']}), lengths lognormal median "
         f"{s['median_tokens']} sigma {s['sigma']} cap {s['max_tokens']}, prompts {s['prompt_tokens_range']}"),
        ("KV cache", f"{s['num_blocks']} blocks = {s['cache_fraction']} x peak demand {s['peak_demand_blocks']} "
         f"(sum of each sample's own blocks); holds ~{s['cache_holds_samples']} samples at full length"),
        ("generated tokens", f"{generated} of {s['tokens_to_generate']}"),
        ("recomputed tokens", f"{s['recomputed_tokens']} (by position {s['recomputed_tokens_by_position']}), "
         f"ratio to generated {s['recompute_ratio']}"),
        ("prompt sharing", f"first admissions computed {s['first_admission_prompt_tokens']} of {s['prompt_tokens']} "
         f"prompt tokens ({s['first_admission_prefix_hit_tokens']} from the prefix cache)"),
        ("readmissions", f"{s['readmissions']} ({s['readmission_prefix_hit_tokens']} of {s['readmission_tokens']} "
         f"tokens from the prefix cache), at most {s['max_admissions_per_sample']} admissions for one sample"),
        ("preemptions", f"{s['preemptions']} ({s['preemptions_swapped']} swapped)"),
        ("swap", f"{s['swap_out_blocks']} blocks out, {s['swap_in_blocks']} in ({s['swap_out_bytes'] / 2**20:.1f} / "
         f"{s['swap_in_bytes'] / 2**20:.1f} MiB at {s['kv_block_bytes']} B per block; {s['swap_space_blocks']} "
         "swap blocks)"),
        ("engine steps", s["steps"]),
        ("running batch", f"{s['mean_decoding_per_step']} decoding per step ({s['mean_sequences_per_step']} "
         f"sequences, {s['mean_running_per_step']} running); {s['mean_decoding_while_queued']} over the "
         f"{s['queued_steps']} steps with requests queued; max_num_seqs {s['max_num_seqs']}"),
        ("long tail", tail_line(s)),
        ("last / median finish", finish_line(s)),
        ("finished", f"{s['finished']}: {s['samples_finished']} of {s['samples']} samples, {s['samples_errored']} "
         f"errors, {s['samples_off_length']} off their length"),
        ("wall time", f"{s['wall_s']} s (budget {s['time_budget_s']} s), {generated / max(s['wall_s'], 1e-9):.0f} "
         "tokens/s"),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:<22}{value}")
    print(f"recomputed = {s['recompute_definition']}", flush=True)
