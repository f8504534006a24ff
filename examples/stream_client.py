"""Stream completions from a running rollout worker, token by token, with the policy version of every token.

rollout-worker --bind tcp://127.0.0.1:5555 &          # the built-in tiny model (the default)
python examples/stream_client.py --worker tcp://127.0.0.1:5555

Text is encoded and decoded with the tiny model's tokenizer, so the text is right only against a worker serving the
tiny model (another model's worker streams just as well, but its ids decode wrongly here). On the tiny model the
decoded text is gibberish, and that is expected: its weights are random (most of its ids stand for letter pairs and
triples). The token ids, logprobs and policy versions are what this example shows.
"""

from __future__ import annotations

import argparse
import sys

from rollout.presets import tiny_tokenizer
from trainer_bridge import Delta, GroupResult, PromptGroup, RolloutClient, RolloutError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default="tcp://127.0.0.1:5555", help="worker address (default: %(default)s)")
    parser.add_argument("--prompt", default="Hello rollout:", help="prompt text (tiny tokenizer)")
    parser.add_argument("--samples", type=int, default=2, help="samples in the group (default: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sample (default: 24)")
    args = parser.parse_args(argv)
    tokenizer = tiny_tokenizer()
    group = PromptGroup(
        tokenizer(args.prompt, add_special_tokens=False)["input_ids"],
        n=args.samples,
        sampling={"temperature": 0.9, "max_new_tokens": args.max_new_tokens, "do_sample": True},
    )
    print("tiny model: random weights, so the text below is gibberish (mostly letter pairs and triples)")
    with RolloutClient(args.worker, timeout=60) as client:
        for event in client.stream(group):
            if isinstance(event, Delta):  # new tokens of one sample, as they are sampled
                text = tokenizer.decode(event.token_ids)
                print(f"sample {event.sample_index} v{event.policy_version}: {event.token_ids} {text!r}")
            elif isinstance(event, GroupResult):  # every sample, once all finished
                for completion in event.completions:
                    print(
                        f"sample {completion.sample_index} finished ({completion.finish_reason}), "
                        f"{len(completion.token_ids)} tokens, versions {completion.policy_versions}"
                    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RolloutError as error:  # no worker at --worker, say: the message says what to check
        sys.exit(f"stream_client: {error}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback
        print("stream_client: interrupted", file=sys.stderr)
        sys.exit(130)
