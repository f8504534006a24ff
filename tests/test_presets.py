"""The built-in preset: a deterministic tiny model and a tokenizer built in code, consistent with each other."""

from __future__ import annotations

import torch

from rollout.presets import tiny_model, tiny_tokenizer


def test_tokenizer_round_trips_text_within_the_models_vocabulary():
    tokenizer = tiny_tokenizer()
    model = tiny_model()
    text = "Q: 12+30=? A: 42.\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id != tokenizer.unk_token_id


def test_preset_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first, second = tiny_model(), tiny_model()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_every_id_the_model_can_sample_decodes_to_text():
    """The tokenizer covers the model's whole vocabulary: each id is its own token, each decodes to text (no id
    decodes to nothing), and encoding text still gives one id per character."""
    tokenizer = tiny_tokenizer()
    vocab_size = tiny_model().config.vocab_size
    assert len(tokenizer) == vocab_size
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    assert len(set(pieces)) == vocab_size and "<unk>" not in pieces[4:]
    assert all(tokenizer.decode([i]) for i in range(4, vocab_size))
    assert tokenizer("ab", add_special_tokens=False)["input_ids"] == [14, 15]  # characters, not the pair "ab"


def test_chat_template_renders_chatml_turns_with_special_markers():
    """transformers' own apply_chat_template on the built-in template: ChatML text, and <|im_start|> / <|im_end|>
    encoded as one special id each; tools are listed in a system turn."""
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(start) == 3 and ids.count(end) == 2 and tokenizer.decode(ids) == text
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    with_tools = tokenizer.apply_chat_template(messages[:1], tools=[tool], tokenize=False)
    assert with_tools.startswith("<|im_start|>system\n") and '"name": "add"' in with_tools


def test_the_tiny_agent_preset_calls_a_tool_then_answers():
    """`--model tiny-agent`: transformers' own sampling and response parser see a tool call in the chat template's
    format (or a refusal) in a fresh turn, each a third, and the answer once a tool result is in the conversation;
    the preset's model and tokenizer come by name, and the noisy variant keeps the script."""
    from rollout.presets import model_from_preset, scripted_agent, tokenizer_for
    from rollout.presets.agent import DEFAULT_CALLS

    model, tokenizer = model_from_preset("tiny-agent"), tokenizer_for("tiny-agent")
    tool = {"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}
    question = [{"role": "user", "content": "What is 3 times 4?"}]
    prompt = tokenizer.apply_chat_template(question, tools=[tool], add_generation_prompt=True, return_dict=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt] * 60), do_sample=True, max_new_tokens=8, top_k=None, top_p=None)
    replies = [row[len(prompt) :].tolist() for row in out]
    replies = [reply[: reply.index(tokenizer.eos_token_id) + 1] for reply in replies]  # generate pads after the end
    parsed = [tokenizer.parse_response(reply, prefix=prompt) for reply in replies]
    calls = [p["tool_calls"][0]["function"] for p in parsed if p.get("tool_calls")]
    refusals = [p for p in parsed if p.get("content") == "I won't"]
    assert len(calls) + len(refusals) == 60
    assert {(c["name"], tuple(c["arguments"].items())) for c in calls} == {
        (c["name"], tuple(c["arguments"].items())) for c in DEFAULT_CALLS
    }
    assert 10 <= len(refusals) <= 30  # a third of 60, sampled
    answered = question + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": DEFAULT_CALLS[0]}]},
        {"role": "tool", "name": "multiply", "content": "12"},
    ]
    for agent in (model, scripted_agent(noise=0.01)[0]):
        ids = tokenizer.apply_chat_template(answered, tools=[tool], add_generation_prompt=True, return_dict=False)
        assert ids[: len(prompt) - 3] == prompt[: len(prompt) - 3]  # the template preserves the conversation's prefix
        with torch.no_grad():
            reply = agent.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)[0, len(ids) :].tolist()
        assert tokenizer.parse_response(reply, prefix=ids) == {"role": "assistant", "content": "Done!"}
